"""The router's token ids equal ``AutoTokenizer.from_pretrained(DIR)``'s, across architectures and layouts.

transformers picks its tokenizer class from the model type and the declared
class; for a Qwen2 checkpoint it rebuilds the pre-tokenizer, which splits
newlines and indentation differently from the bare ``tokenizer.json``.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from shared.tokenizer import Tokenizer

TEXTS = [
    "def parse(args):\n    return",
    "def parse(args):\n    return  x\n\n\n  y = 123456\r\n\tz",
    "Caf\u00e9 \u4e16\u754c! It's   spaced   out.\n",
    "   leading spaces and trailing   ",
]
MESSAGES = [{"role": "user", "content": "def f():\n    return 1\n"}]
LAYOUTS = {
    "as-written": None,
    "no-tokenizer-class": lambda cfg: cfg.pop("tokenizer_class", None),
    "declared-qwen2": lambda cfg: cfg.update(tokenizer_class="Qwen2TokenizerFast"),
}


def tokenizer_dir(source: Path, dest: Path, layout) -> Path:
    """The checkpoint's tokenizer and config files (no weights), with ``tokenizer_config.json`` edited."""
    dest.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json", "config.json", "chat_template.jinja"):
        if (source / name).is_file():
            shutil.copy(source / name, dest / name)
    if layout is not None:
        config = json.loads((dest / "tokenizer_config.json").read_text())
        layout(config)
        (dest / "tokenizer_config.json").write_text(json.dumps(config))
    return dest


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "mistral"])
def test_token_ids_equal_autotokenizer(checkpoint_factory, tmp_path, arch, layout):
    from transformers import AutoTokenizer

    model_dir = tokenizer_dir(checkpoint_factory(arch), tmp_path / "tok", LAYOUTS[layout])
    hf = AutoTokenizer.from_pretrained(model_dir)
    ours = Tokenizer.from_dir(model_dir)
    for text in TEXTS:
        assert ours.encode(text) == hf(text)["input_ids"], (type(hf).__name__, text)
        assert ours.encode(text, add_special_tokens=False) == hf(text, add_special_tokens=False)["input_ids"]
        ids = hf(text, add_special_tokens=False)["input_ids"]
        assert ours.decode(ids) == hf.decode(ids, skip_special_tokens=True)
    if ours.has_chat_template:
        rendered = hf.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
        assert ours.apply_chat_template(MESSAGES) == rendered
        assert ours.encode(rendered, add_special_tokens=False) == hf(rendered, add_special_tokens=False)["input_ids"]


def test_qwen2_splits_newline_and_indent_apart(checkpoint_factory):
    ours = Tokenizer.from_dir(checkpoint_factory("qwen2"))
    ids = ours.encode("def parse(args):\n    return", add_special_tokens=False)
    pieces = [ours.id_to_token(t) for t in ids]
    assert "\u010a" in pieces and "\u010a\u0120\u0120\u0120" not in pieces  # 'Ċ' alone, not 'ĊĠĠĠ'
