"""The prompt's logprobs in responses: vLLM's ``prompt_logprobs`` and completions' ``echo`` with ``logprobs``.

The worker that computed the prompt scores tokens 1..; the first prompt token
has no logprob (nothing precedes it) and shows as ``null`` in both shapes.
"""

from __future__ import annotations

from services.router.generation import PromptTokenLogprob
from services.router.protocol import CompletionLogprobs, PromptLogprob, PromptLogprobs

# JSON has no -inf; impossible tokens are clamped to this (as for generated tokens).
MIN_LOGPROB = -9999.0


def _lp(value: float) -> float:
    return max(value, MIN_LOGPROB)


def prompt_logprobs_body(infos: list[PromptTokenLogprob] | None) -> PromptLogprobs | None:
    """``[None, {token id: {logprob, rank, decoded_token}, ...}, ...]``: the prompt token and its alternatives."""
    if infos is None:
        return None
    body: PromptLogprobs = [None]
    for info in infos:
        entry = {
            str(token_id): PromptLogprob(logprob=_lp(lp), rank=rank, decoded_token=text)
            for rank, (token_id, text, lp) in enumerate(info.top, start=1)
        }
        entry[str(info.token_id)] = PromptLogprob(logprob=_lp(info.logprob), rank=info.rank, decoded_token=info.token)
        body.append(entry)
    return body


def echo_logprobs(token_texts: list[str], infos: list[PromptTokenLogprob] | None, num_top: int) -> CompletionLogprobs:
    """Completions ``logprobs`` of the echoed prompt: ``token_texts`` are its tokens as text."""
    infos = infos or []
    offsets, position = [], 0
    for text in token_texts:
        offsets.append(position)
        position += len(text)
    top: list[dict[str, float] | None] = [None]
    for info in infos:
        entry = {text: _lp(lp) for _, text, lp in info.top[:num_top]}
        top.append({info.token: _lp(info.logprob)} | entry)
    return CompletionLogprobs(
        text_offset=offsets,
        token_logprobs=[None] + [_lp(i.logprob) for i in infos],
        tokens=list(token_texts),
        top_logprobs=top,
    )


def join(echoed: CompletionLogprobs, generated: CompletionLogprobs | None, shift: int) -> CompletionLogprobs:
    """The prompt's entries, then the generated ones with their offsets moved past the echoed text."""
    if generated is None:
        return echoed
    return CompletionLogprobs(
        text_offset=echoed.text_offset + [o + shift for o in generated.text_offset],
        token_logprobs=echoed.token_logprobs + generated.token_logprobs,
        tokens=echoed.tokens + generated.tokens,
        top_logprobs=echoed.top_logprobs + generated.top_logprobs,
    )
