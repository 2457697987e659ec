"""The tokenizer a GGUF file describes, as ``tokenizer.json`` + ``tokenizer_config.json`` (torch-free).

Byte-level BPE vocabularies (``tokenizer.ggml.model == "gpt2"``: Llama 3, Qwen2/3,
SmolLM) and sentencepiece ones (``"llama"``: Llama 2, Mistral) are rebuilt with the ``tokenizers`` library the way transformers' GGUF
loader rebuilds them: the vocabulary and merges from the file, control tokens
as special added tokens, user-defined ones as plain added tokens, the split
regex named by ``tokenizer.ggml.pre`` where it differs from GPT-2's, and BOS
prepended as ``tokenizer.ggml.add_bos_token`` says (sentencepiece: yes unless it says no).
"""

from __future__ import annotations

import json
from functools import lru_cache
from pathlib import Path
from typing import Any

from shared.models.config import ModelLoadError
from shared.models.gguf_file import GGUFCheckpoint

CONTROL, USER_DEFINED = 3, 4  # llama.cpp token types

_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# ``tokenizer.ggml.pre`` values whose split differs from GPT-2's byte-level regex.
PRE_TOKENIZER_SPLITS = {
    "llama3": _LLAMA3_SPLIT,
    "llama-v3": _LLAMA3_SPLIT,
    "llama-bpe": _LLAMA3_SPLIT,
    "smaug-bpe": _LLAMA3_SPLIT,
    "qwen2": _QWEN2_SPLIT,
    "deepseek-r1-qwen": _QWEN2_SPLIT,
}
SUPPORTED_TOKENIZER_MODELS = ("gpt2", "llama")


@lru_cache(maxsize=1)
def _byte_alphabet() -> dict[int, str]:
    """GPT-2's byte -> printable character map."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
    printable += list(range(ord("®"), ord("ÿ") + 1))
    chars = list(printable)
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return {b: chr(c) for b, c in zip(printable, chars, strict=True)}


def _backend(checkpoint: GGUFCheckpoint) -> Any:
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors

    tokens: list[str] = checkpoint.field("tokenizer.ggml.tokens")
    types: list[int] = checkpoint.field("tokenizer.ggml.token_type") or [1] * len(tokens)
    merges = [tuple(m.split(" ", 1)) for m in checkpoint.field("tokenizer.ggml.merges") or []]
    spelling = _byte_alphabet()
    alphabet = set(spelling.values())
    vocab = {
        tok if set(tok) <= alphabet else "".join(spelling[b] for b in tok.encode("utf-8")): i
        for i, tok in enumerate(tokens)
    }
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
    split = PRE_TOKENIZER_SPLITS.get(str(checkpoint.field("tokenizer.ggml.pre", "")))
    if split is None:
        tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    else:
        tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Split(Regex(split), behavior="isolated"), pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
        )  # fmt: skip
    tokenizer.decoder = decoders.ByteLevel()
    # A control token spelled outside the byte alphabet is a mislabel; adding it would grow the vocabulary.
    tokenizer.add_special_tokens(
        [AddedToken(t, special=True, normalized=False) for t, k in zip(tokens, types, strict=True) if k == CONTROL and set(t) <= alphabet]
    )  # fmt: skip
    tokenizer.add_tokens(
        [AddedToken(t, special=False, normalized=False) for t, k in zip(tokens, types, strict=True) if k == USER_DEFINED and t in vocab]
    )  # fmt: skip
    bos_id = checkpoint.field("tokenizer.ggml.bos_token_id")
    add_bos = bool(checkpoint.field("tokenizer.ggml.add_bos_token", False)) and bos_id is not None
    if add_bos:
        bos = tokens[int(bos_id)]
        tokenizer.post_processor = processors.TemplateProcessing(
            single=f"{bos}:0 $A:0", pair=f"{bos}:0 $A:0 {bos}:1 $B:1", special_tokens=[(bos, int(bos_id))]
        )
    return tokenizer


def _spm_merges(vocab: dict[str, int], scores: dict[str, float]) -> list[tuple[str, str]]:
    """BPE merges implied by a sentencepiece vocabulary: every split of a piece into two pieces, best score first."""
    merges = []
    for piece, score in scores.items():
        local = [
            (piece[:i], piece[i:], score) for i in range(1, len(piece)) if piece[:i] in vocab and piece[i:] in vocab
        ]
        merges.extend(sorted(local, key=lambda m: (vocab[m[0]], vocab[m[1]])))
    merges.sort(key=lambda m: (m[2], len(m[0]), len(m[1])), reverse=True)
    return [(left, right) for left, right, _ in merges]


def _spm_backend(checkpoint: GGUFCheckpoint) -> Any:
    """A sentencepiece (``llama``) vocabulary as a byte-fallback BPE with a ``▁`` prefix, as transformers builds it."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors

    tokens: list[str] = checkpoint.field("tokenizer.ggml.tokens")
    types: list[int] = checkpoint.field("tokenizer.ggml.token_type") or [1] * len(tokens)
    scores: list[float] = checkpoint.field("tokenizer.ggml.scores") or [0.0] * len(tokens)
    vocab = {tok: i for i, tok in enumerate(tokens)}
    file_merges = checkpoint.field("tokenizer.ggml.merges")
    merges = [tuple(m.split(" ", 1)) for m in file_merges] if file_merges else _spm_merges(vocab, dict(zip(tokens, scores, strict=True)))  # fmt: skip
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=True, byte_fallback=True))
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="first", split=False)
    tokenizer.decoder = decoders.Sequence(
        [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(content=" ", left=1)]
    )
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False) for t, k in zip(tokens, types, strict=True) if k == CONTROL])  # fmt: skip
    tokenizer.add_tokens([AddedToken(t, special=False, normalized=False) for t, k in zip(tokens, types, strict=True) if k == USER_DEFINED])  # fmt: skip
    bos_id = checkpoint.field("tokenizer.ggml.bos_token_id")
    # llama.cpp adds BOS to a sentencepiece vocabulary unless the file says otherwise.
    if bool(checkpoint.field("tokenizer.ggml.add_bos_token", True)) and bos_id is not None:
        bos = tokens[int(bos_id)]
        tokenizer.post_processor = processors.TemplateProcessing(
            single=f"{bos}:0 $A:0", pair=f"{bos}:0 $A:0 {bos}:1 $B:1", special_tokens=[(bos, int(bos_id))]
        )
    return tokenizer


def tokenizer_parts(checkpoint: GGUFCheckpoint) -> tuple[str, dict[str, Any]]:
    """(``tokenizer.json`` text, ``tokenizer_config.json`` dict incl. the chat template)."""
    model = checkpoint.field("tokenizer.ggml.model")
    if model not in SUPPORTED_TOKENIZER_MODELS:
        raise ModelLoadError(
            f"{checkpoint.path}: GGUF tokenizer model {model!r} is not supported; "
            f"supported: gpt2 (byte-level BPE), llama (sentencepiece)"
        )
    tokens: list[str] = checkpoint.field("tokenizer.ggml.tokens")
    config: dict[str, Any] = {"tokenizer_class": "PreTrainedTokenizerFast", "clean_up_tokenization_spaces": False}
    for name, key in (("bos_token", "bos_token_id"), ("eos_token", "eos_token_id"),
                      ("unk_token", "unknown_token_id"), ("pad_token", "padding_token_id")):  # fmt: skip
        token_id = checkpoint.field(f"tokenizer.ggml.{key}")
        if token_id is not None and 0 <= int(token_id) < len(tokens):
            config[name] = tokens[int(token_id)]
    config["model_max_length"] = int(checkpoint.arch_field("context_length", 2048))
    template = checkpoint.field("tokenizer.chat_template")
    if template:
        config["chat_template"] = str(template)
    backend = _spm_backend(checkpoint) if model == "llama" else _backend(checkpoint)
    return backend.to_str(), config


def write_tokenizer(checkpoint: GGUFCheckpoint, model_dir: Path) -> None:
    """Write ``tokenizer.json`` and ``tokenizer_config.json`` (with ``chat_template``) into ``model_dir``."""
    tokenizer_json, config = tokenizer_parts(checkpoint)
    (model_dir / "tokenizer.json").write_text(tokenizer_json, encoding="utf-8")
    with open(model_dir / "tokenizer_config.json", "w", encoding="utf-8") as f:
        json.dump(config, f, indent=2, ensure_ascii=False)
