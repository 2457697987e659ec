"""Request fields that work on token ids: validated here, with errors that name the field and the limit.

``logit_bias`` (OpenAI: token id strings to a bias in [-100, 100]),
``allowed_token_ids`` and ``bad_words`` (vLLM) become the engine's
``SamplingParams`` token controls; ``truncate_prompt_tokens`` (vLLM) keeps the
last tokens of a prompt.
"""

from __future__ import annotations

from typing import Any

from services.router.protocol import SamplingRequest, bad_request
from shared.tokenizer import Tokenizer

MAX_LOGIT_BIAS = 100.0


def check_vocab(token_ids: list[int], vocab_size: int, param: str) -> None:
    """400 naming ``param`` for the first id outside the vocabulary."""
    for token_id in token_ids:
        if not 0 <= token_id < vocab_size:
            raise bad_request(f"{param}: token id {token_id} is out of vocabulary (size {vocab_size})", param)


def _logit_bias(raw: dict[str, float], vocab_size: int) -> dict[int, float]:
    bias: dict[int, float] = {}
    for key, value in raw.items():
        try:
            token_id = int(key)
        except ValueError:
            raise bad_request(f"logit_bias: keys must be token ids, got {key!r}", "logit_bias") from None
        check_vocab([token_id], vocab_size, "logit_bias")
        if not -MAX_LOGIT_BIAS <= value <= MAX_LOGIT_BIAS:
            raise bad_request(f"logit_bias: bias {value} for token {token_id} is outside [-100, 100]", "logit_bias")
        bias[token_id] = float(value)
    return bias


def bad_words_token_ids(words: list[str], tokenizer: Tokenizer) -> list[list[int]]:
    """Each word as tokens, alone and after a space (as it reads mid-sentence); duplicates once."""
    sequences: list[list[int]] = []
    for word in words:
        stripped = word.lstrip()
        if not stripped:
            raise bad_request("bad_words: words must not be empty", "bad_words")
        for text in (stripped, " " + stripped):
            ids = tokenizer.encode(text, add_special_tokens=False)
            if ids and ids not in sequences:
                sequences.append(ids)
    return sequences


def token_controls(req: SamplingRequest, tokenizer: Tokenizer, vocab_size: int) -> dict[str, Any]:
    """Keyword arguments of ``SamplingParams`` for the request's token controls."""
    controls: dict[str, Any] = {}
    if req.logit_bias:
        controls["logit_bias"] = _logit_bias(req.logit_bias, vocab_size)
    if req.allowed_token_ids is not None:
        if not req.allowed_token_ids:
            raise bad_request("allowed_token_ids must not be empty", "allowed_token_ids")
        check_vocab(req.allowed_token_ids, vocab_size, "allowed_token_ids")
        controls["allowed_token_ids"] = list(req.allowed_token_ids)
    if req.bad_words:
        controls["bad_words_token_ids"] = bad_words_token_ids(req.bad_words, tokenizer)
    return controls


def truncate_prompt(prompt_ids: list[int], truncate: int | None, max_model_len: int) -> list[int]:
    """The last ``truncate`` tokens (-1: the model's context length); None keeps the prompt."""
    if truncate is None:
        return prompt_ids
    if truncate == -1:
        truncate = max_model_len
    if truncate < 1:
        raise bad_request(f"truncate_prompt_tokens must be -1 or at least 1, got {truncate}", "truncate_prompt_tokens")
    if truncate > max_model_len:
        raise bad_request(
            f"truncate_prompt_tokens ({truncate}) must not exceed the model's context length ({max_model_len})",
            "truncate_prompt_tokens",
        )
    return prompt_ids[-truncate:]
