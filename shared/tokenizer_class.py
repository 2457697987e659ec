"""The text pipeline transformers uses for a checkpoint, where it is not the one in ``tokenizer.json``.

``AutoTokenizer`` (transformers 5) picks a tokenizer class from
``tokenizer_config.json``'s ``tokenizer_class`` and the model type in
``config.json``; for some model types (``qwen2`` among them) it trusts the
model type over the declared class. A class with its own pipeline (Qwen2's)
keeps only the vocabulary, merges, added tokens and post-processor of
``tokenizer.json`` and rebuilds the normalizer, pre-tokenizer and decoder. The
same prompt then splits differently (``"\\n    return"`` gives ``Ċ``, ``ĠĠĠ``,
``Ġreturn`` with Qwen2's regex, ``ĊĠĠĠ`` with a bare byte-level one), so the
router applies the same pipeline to its ``tokenizers`` backend.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from tokenizers import Regex, decoders, normalizers, pre_tokenizers
from tokenizers import Tokenizer as BackendTokenizer

# Qwen2's pre-tokenizer split (a fact of the Qwen2 tokenizer, as transformers defines it).
QWEN2_SPLIT = r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
# Model types whose tokenizer class transformers takes from the model type, whatever the config declares.
MODEL_TYPE_OVERRIDES = {"qwen2": "Qwen2Tokenizer"}
# Model types whose tokenizer.json transformers loads as it is, whatever class the config declares.
TOKENIZER_JSON_AS_IS = {"mistral"}
# Model types whose class transformers takes from the model type when the config declares none.
MODEL_TYPE_DEFAULTS = {"qwen2": "Qwen2Tokenizer", "qwen2_moe": "Qwen2Tokenizer", "qwen3": "Qwen2Tokenizer"}


def _model_type(model_dir: Path) -> str | None:
    path = model_dir / "config.json"
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text(encoding="utf-8")).get("model_type")
    except (OSError, ValueError):
        return None


def resolve_tokenizer_class(model_dir: Path, config: Mapping[str, Any]) -> str | None:
    """The class ``AutoTokenizer`` would load, for the classes whose pipeline differs; None otherwise."""
    model_type = _model_type(model_dir)
    declared = config.get("tokenizer_class")
    declared = declared.removesuffix("Fast") if isinstance(declared, str) else None
    if model_type in MODEL_TYPE_OVERRIDES:
        return MODEL_TYPE_OVERRIDES[model_type]
    if model_type in TOKENIZER_JSON_AS_IS:
        return None
    if declared is None and model_type in MODEL_TYPE_DEFAULTS:
        return MODEL_TYPE_DEFAULTS[model_type]
    return declared if declared == "Qwen2Tokenizer" else None


def apply_class_pipeline(backend: BackendTokenizer, class_name: str | None, config: Mapping[str, Any]) -> None:
    """Give ``backend`` the normalizer, pre-tokenizer and decoder of ``class_name`` (in place)."""
    if class_name != "Qwen2Tokenizer":
        return
    add_prefix_space = bool(config.get("add_prefix_space") or False)
    backend.normalizer = normalizers.NFC()
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN2_SPLIT), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=add_prefix_space, use_regex=False),
        ]
    )
    backend.decoder = decoders.ByteLevel()
