"""``n > 1`` with a prefill pool: pull the prompt's KV once, then fork on this worker.

The prefill worker samples one first token; a fork needs ``n`` of them, each
drawn with its own seed. So the request drops that token and recomputes the
prompt's last position here: one token of compute, after which the engine forks
the children exactly as in the aggregated path (shared blocks, copy-on-write),
and every sample, the first included, equals what the aggregated path gives.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from shared.engine.request import Request

Admit = Callable[[Request], None]


def resample_first_token(req: Request, admit: Admit | None, block_size: int, fresh_matcher: Any = None) -> Admit | None:
    """Undo the prefill worker's first token on a forking ``req``; wrap ``admit`` to recompute its last position.

    ``admit`` None (the pull failed, the prompt is recomputed here) needs only the first part.
    ``fresh_matcher``: with structured output, a new grammar matcher (the old one accepted the token).
    """
    assert req.num_output_tokens == 1, "a pulled request carries exactly the prefill's first token"
    req.output_token_ids.pop()
    req.token_ids.pop()
    if req.matcher is not None:
        req.matcher = fresh_matcher
    del req._block_hashes[req.num_tokens // block_size :]  # a hash may have covered the dropped token
    if admit is None:
        return None

    def join(r: Request) -> None:
        admit(r)  # the pulled KV holds every prompt token
        r.num_computed_tokens = r.num_tokens - 1  # the last one again: its logits sample all n first tokens

    return join
