"""The torch-free tokenizer matches transformers, streams text exactly, and finds stop strings."""

from __future__ import annotations

import json
import random
import subprocess
import sys

import pytest
from tokenizers import Tokenizer as BackendTokenizer
from tokenizers import decoders, models, normalizers, pre_tokenizers, trainers
from transformers import AutoTokenizer

from shared.models.demo import write_tokenizer_files
from shared.tokenizer import IncrementalDetokenizer, Tokenizer, find_stop, holdback_len

TEXTS = [
    "",
    "Hello world",
    "  leading and trailing spaces  ",
    "The kitchen was warm, and Anna baked 12 loaves of bread at 6:30 a.m.!",
    "Tabs\tand\nnewlines\n\n  mixed   spacing",
    "naïve café — déjà vu, “quoted” ‘text’",
    "emoji 😀🎉👍🏽 and flags 🇫🇷 plus ZWJ 👩‍👩‍👧",
    "中文文本，日本語のテキスト、한국어 텍스트",
    "Ελληνικά, русский, العربية, עברית",
    "<|im_start|>user\nhi<|im_end|> literal special tokens <|end_of_text|>",
    "code: def f(x): return {'a': [1, 2, 3]} # comment",
]

CONVERSATIONS = [
    [{"role": "user", "content": "Hello there!"}],
    [
        {"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": "What is 2+2? 🤔"},
        {"role": "assistant", "content": "4"},
        {"role": "user", "content": "And 3+3?"},
    ],
    [{"role": "user", "content": [{"type": "text", "text": "part one, "}, {"type": "text", "text": "part two"}]}],
]


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tokenizer")
    write_tokenizer_files(path)
    return path


@pytest.fixture(scope="module")
def ours(tokenizer_dir):
    return Tokenizer.from_dir(tokenizer_dir)


@pytest.fixture(scope="module")
def hf(tokenizer_dir):
    return AutoTokenizer.from_pretrained(tokenizer_dir)


@pytest.mark.parametrize("add_special_tokens", [True, False])
def test_encode_matches_hf(ours, hf, add_special_tokens):
    for text in TEXTS:
        assert ours.encode(text, add_special_tokens) == hf.encode(text, add_special_tokens=add_special_tokens), text


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_decode_matches_hf(ours, hf, skip_special_tokens):
    for text in TEXTS:
        ids = hf.encode(text)
        assert ours.decode(ids, skip_special_tokens) == hf.decode(ids, skip_special_tokens=skip_special_tokens)
        assert ours.decode(ids, skip_special_tokens=True) == text.replace("<|im_start|>", "").replace(
            "<|im_end|>", ""
        ).replace("<|end_of_text|>", "")


def test_special_ids_and_sizes_match_hf(ours, hf):
    assert ours.bos_token_id == hf.bos_token_id == 0
    assert ours.eos_token_id == hf.eos_token_id == 1
    assert ours.vocab_size == len(hf) == 4096
    assert ours.all_special_ids == sorted(hf.all_special_ids) == [0, 1, 2, 3]


@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_template_matches_hf(ours, hf, add_generation_prompt):
    for messages in CONVERSATIONS:
        expected = hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
        assert ours.apply_chat_template(messages, add_generation_prompt) == expected
    prompt = ours.apply_chat_template(CONVERSATIONS[0])
    assert prompt.startswith("<|begin_of_text|><|im_start|>user\n") and prompt.endswith("<|im_start|>assistant\n")
    assert ours.encode(prompt, add_special_tokens=False) == hf.apply_chat_template(
        CONVERSATIONS[0], add_generation_prompt=True, return_dict=False
    )


def test_chat_template_file_takes_precedence_and_sandbox_helpers_work(tokenizer_dir, tmp_path):
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (tmp_path / name).write_bytes((tokenizer_dir / name).read_bytes())
    (tmp_path / "chat_template.jinja").write_text(
        "{% for m in messages %}{% if m.role == 'tool' %}{{ raise_exception('no tools') }}{% endif %}"
        "[{{ m.role | upper }}]{{ m.content | tojson }}{{ eos_token }}\n{% endfor %}"
        "{% if add_generation_prompt %}[ASSISTANT]{% endif %}"
    )
    ours, hf = Tokenizer.from_dir(tmp_path), AutoTokenizer.from_pretrained(tmp_path)
    messages = [{"role": "user", "content": 'say "héllo" <b>'}]
    expected = hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert ours.apply_chat_template(messages) == expected == '[USER]"say \\"héllo\\" <b>"<|end_of_text|>\n[ASSISTANT]'
    with pytest.raises(Exception, match="no tools"):
        ours.apply_chat_template([{"role": "tool", "content": "x"}])


def test_add_bos_eos_flags_defer_to_tokenizer_json_like_hf(tokenizer_dir, tmp_path):
    (tmp_path / "tokenizer.json").write_bytes((tokenizer_dir / "tokenizer.json").read_bytes())
    config = json.loads((tokenizer_dir / "tokenizer_config.json").read_text())
    config.update(add_bos_token=False, add_eos_token=True)
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    ours, hf = Tokenizer.from_dir(tmp_path), AutoTokenizer.from_pretrained(tmp_path)
    ids = ours.encode("Hello world")
    assert ids == hf.encode("Hello world") and ids[0] == 0 and ids[-1] != 1


def test_tokenizer_module_imports_neither_torch_nor_transformers():
    code = "import sys, shared.tokenizer; sys.exit(bool({'torch', 'transformers'} & set(sys.modules)))"
    assert subprocess.run([sys.executable, "-c", code], check=False).returncode == 0


def stream(tokenizer, ids, skip_special_tokens=True) -> list[str]:
    detok = IncrementalDetokenizer(tokenizer, [0, 5, 6], skip_special_tokens)
    deltas = [detok.add(t) for t in ids]
    return deltas + [detok.flush()]


def test_streamed_text_equals_decode_for_multibyte_text(ours):
    for text in TEXTS:
        ids = ours.encode(text, add_special_tokens=False)
        for skip in (True, False):
            deltas = stream(ours, ids, skip)
            assert "".join(deltas) == ours.decode(ids, skip), text
            # Valid text never streams a half character.
            assert not any("\ufffd" in d for d in deltas), text


def test_streaming_holds_back_split_characters_until_complete(ours):
    ids = ours.encode("a😀", add_special_tokens=False)
    assert len(ids) >= 3  # the emoji's 4 bytes span several byte-level tokens
    deltas = stream(ours, ids)
    assert deltas[0] == "a" and all(d == "" for d in deltas[1:-2]) and deltas[-2] == "😀"


def test_streamed_text_equals_decode_for_random_token_sequences(ours):
    rng = random.Random(0)
    byte_tokens = [
        i for i in range(ours.vocab_size) if len(ours.decode([i], False)) == 1 and "\ufffd" in ours.decode([i])
    ]
    assert byte_tokens, "the byte-level alphabet should contain partial UTF-8 byte tokens"
    for _ in range(200):
        pool = range(ours.vocab_size) if rng.random() < 0.5 else byte_tokens + [0, 1, 2, 3]
        ids = [rng.choice(pool) for _ in range(rng.randint(1, 30))]
        skip = rng.random() < 0.5
        assert "".join(stream(ours, ids, skip)) == ours.decode(ids, skip), ids


def metaspace_tokenizer(corpus: list[str]) -> Tokenizer:
    """Metaspace pre-tokenizer and decoder: the first token's leading space is dropped."""
    backend = BackendTokenizer(models.BPE(unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="first")
    backend.decoder = decoders.Metaspace(replacement="\u2581", prepend_scheme="first")
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<unk>", "<s>", "</s>"], show_progress=False)
    backend.train_from_iterator(corpus, trainer=trainer)
    return Tokenizer(backend, {"bos_token": "<s>", "eos_token": "</s>"})


def byte_fallback_tokenizer(corpus: list[str]) -> Tokenizer:
    """Llama-2 style: <0xNN> byte tokens, a ByteFallback/Fuse/Strip decoder chain."""
    trained = metaspace_tokenizer(corpus)._backend
    spec = json.loads(trained.to_str())["model"]
    vocab = dict(spec["vocab"])
    vocab.update({f"<0x{b:02X}>": len(spec["vocab"]) + b for b in range(256)})
    merges = [tuple(m) if isinstance(m, list) else tuple(m.split(" ")) for m in spec["merges"]]
    backend = BackendTokenizer(models.BPE(vocab=vocab, merges=merges, unk_token="<unk>", byte_fallback=True))
    backend.add_special_tokens(["<unk>", "<s>", "</s>"])
    backend.normalizer = normalizers.Sequence([normalizers.Prepend("\u2581"), normalizers.Replace(" ", "\u2581")])
    backend.decoder = decoders.Sequence(
        [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    return Tokenizer(backend, {"bos_token": "<s>", "eos_token": "</s>"})


@pytest.mark.parametrize("build", [metaspace_tokenizer, byte_fallback_tokenizer])
def test_streaming_with_sentencepiece_style_decoders(ours, build):
    """Leading-space stripping and byte-fallback runs (whole run -> U+FFFD if invalid) stream exactly."""
    tokenizer = build([ours.decode(ours.encode(t)) for t in TEXTS[:5]] * 3)
    rng = random.Random(1)
    byte_ids = sorted(tokenizer.byte_fallback_ids) or list(range(3, 40))
    for _ in range(300):
        pool = range(tokenizer.vocab_size) if rng.random() < 0.5 else byte_ids + [1, 2, 5, 6]
        ids = [rng.choice(pool) for _ in range(rng.randint(1, 25))]
        skip = rng.random() < 0.5
        assert "".join(stream(tokenizer, ids, skip)) == tokenizer.decode(ids, skip), ids
    for text in TEXTS:
        ids = tokenizer.encode(text, add_special_tokens=False)
        deltas = stream(tokenizer, ids)
        assert "".join(deltas) == tokenizer.decode(ids) and not any("\ufffd" in d for d in deltas), text


def test_find_stop():
    assert find_stop("hello world", ["wor"], 0) == 6
    assert find_stop("hello world", ["xyz", "o w", "ld"], 0) == 4
    assert find_stop("hello world", ["zzz"], 0) is None
    assert find_stop("hello", [], 0) is None
    assert find_stop("hello", [""], 0) is None
    # Only matches reaching past `start` are considered, but a match may begin before it.
    assert find_stop("abcSTOPdef", ["STOP"], 5) == 3
    assert find_stop("STOP then text", ["STOP"], 10) is None
    assert find_stop("xxSTOP", ["P", "STOP"], 5) == 2  # earliest start wins, not first listed
    assert find_stop("xxSTOP", ["STOP"], 6) is None  # nothing new since the last search


def test_holdback_len():
    assert holdback_len("hello wo", ["world"]) == 2
    assert holdback_len("hello w", ["world", "wow"]) == 1
    assert holdback_len("hello ", ["world"]) == 0
    assert holdback_len("hello world", ["world"]) == 0  # a complete stop string is find_stop's job
    assert holdback_len("ab", ["abc", "b"]) == 2
    assert holdback_len("", ["abc"]) == 0
    assert holdback_len("abc", []) == 0
