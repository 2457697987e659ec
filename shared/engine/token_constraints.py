"""Token-level logit controls of a step, batched: ``allowed_token_ids``, bad words, ``logit_bias``.

``build_token_constraints`` gathers, once per step, the (row, token id) pairs
the rows of a batch ask for; ``apply_token_constraints`` edits the whole
``[B, V]`` logits tensor with three scatter ops, whatever the number of rows:

1. ``allowed_token_ids``: every other token of the row is set to -inf.
2. bad words (vLLM semantics, over the output tokens): the last token of a bad
   word is set to -inf when the row's output ends with the word's other tokens
   (a one-token word is always banned).
3. ``logit_bias``: the bias is added to the token's logit (+100 all but forces
   it, -100 all but bans it).

Token ids outside the vocabulary are skipped here; the router refuses them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from shared.engine.sampling_params import SamplingParams

_NEG_INF = float("-inf")


@dataclass
class TokenConstraints:
    """Per-step controls as flat (row, token id) index tensors; None where no row asks."""

    allowed_rows: Tensor | None  # [A] int64, with allowed_ids: tokens that stay possible
    allowed_ids: Tensor | None  # [A] int64
    restricted_rows: Tensor | None  # [R] int64, rows that have an allowed list
    banned_rows: Tensor | None  # [M] int64, with banned_ids: logits set to -inf
    banned_ids: Tensor | None  # [M] int64
    bias_rows: Tensor | None  # [N] int64, with bias_ids and bias_values: added to logits
    bias_ids: Tensor | None  # [N] int64
    bias_values: Tensor | None  # [N] float32


def _banned_next_tokens(bad_words: list[list[int]], output: list[int]) -> list[int]:
    """Last tokens of the bad words whose other tokens end ``output``."""
    banned = []
    for word in bad_words:
        prefix = word[:-1]
        if not prefix or output[len(output) - len(prefix) :] == prefix:
            banned.append(word[-1])
    return banned


def _index(values: list[int], device: torch.device | str) -> Tensor | None:
    return torch.tensor(values, dtype=torch.int64, device=device) if values else None


def build_token_constraints(
    params: list[SamplingParams], output_token_ids: list[list[int]], vocab_size: int, device: torch.device | str
) -> TokenConstraints | None:
    """The step's controls, or None when no row of the batch has any (the common case costs one scan)."""
    if not any(p.logit_bias or p.allowed_token_ids is not None or p.bad_words_token_ids for p in params):
        return None
    allowed_rows: list[int] = []
    allowed_ids: list[int] = []
    restricted: list[int] = []
    banned_rows: list[int] = []
    banned_ids: list[int] = []
    bias_rows: list[int] = []
    bias_ids: list[int] = []
    bias_values: list[float] = []
    for row, (p, output) in enumerate(zip(params, output_token_ids, strict=True)):
        if p.allowed_token_ids is not None:
            restricted.append(row)
            ids = sorted({t for t in p.allowed_token_ids if t < vocab_size})
            allowed_rows += [row] * len(ids)
            allowed_ids += ids
        if p.bad_words_token_ids:
            ids = sorted({t for t in _banned_next_tokens(p.bad_words_token_ids, output) if t < vocab_size})
            banned_rows += [row] * len(ids)
            banned_ids += ids
        for token_id, bias in p.logit_bias.items():
            if token_id < vocab_size:
                bias_rows.append(row)
                bias_ids.append(token_id)
                bias_values.append(bias)
    return TokenConstraints(
        allowed_rows=_index(allowed_rows, device),
        allowed_ids=_index(allowed_ids, device),
        restricted_rows=_index(restricted, device),
        banned_rows=_index(banned_rows, device),
        banned_ids=_index(banned_ids, device),
        bias_rows=_index(bias_rows, device),
        bias_ids=_index(bias_ids, device),
        bias_values=torch.tensor(bias_values, dtype=torch.float32, device=device) if bias_values else None,
    )


def apply_token_constraints(logits: Tensor, constraints: TokenConstraints) -> Tensor:
    """``logits`` [B, V] with the step's controls applied; returns a new tensor."""
    c = constraints
    if c.restricted_rows is not None:
        blocked = torch.zeros_like(logits, dtype=torch.bool)  # [B, V]
        blocked[c.restricted_rows] = True
        if c.allowed_rows is not None:
            blocked[c.allowed_rows, c.allowed_ids] = False
        logits = logits.masked_fill(blocked, _NEG_INF)
    if c.banned_rows is not None:
        assert c.banned_ids is not None
        logits = logits.index_put((c.banned_rows, c.banned_ids), torch.tensor(_NEG_INF, device=logits.device))
    if c.bias_rows is not None:
        assert c.bias_ids is not None and c.bias_values is not None
        bias = c.bias_values.to(logits.dtype)
        logits = logits.index_put((c.bias_rows, c.bias_ids), bias, accumulate=True)
    return logits
