"""Embeddings: pooling of the prompt's final hidden states, batched with every other request.

An embedding request is a one-token request with ``SamplingParams.pooling``
set. Each prefill chunk adds its rows of the final (normed) hidden states to
the request's running sum (``mean``) or keeps the last prompt row (``last``);
when the chunk holding the last prompt token is computed, the pooled vector
is finished (L2-normalized if asked) and handed out once. A recompute after
preemption restarts at position 0, which resets the sum.
"""

from __future__ import annotations

import torch
from torch import Tensor

from shared.engine.scheduler import SchedulerOutput


class Pooler:
    """Running pooled sums per request; ``step`` returns the embeddings finished in a step."""

    def __init__(self) -> None:
        self._sums: dict[str, tuple[Tensor, int]] = {}  # request id -> ([hidden] float32 sum, rows)

    def release(self, request_id: str) -> None:
        self._sums.pop(request_id, None)

    def step(self, hidden: Tensor, sched: SchedulerOutput) -> dict[str, list[float]]:
        """hidden [T, hidden] of the step -> {request id: embedding} for requests whose prompt is done."""
        done: dict[str, list[float]] = {}
        offset = 0
        for seq in sched.seqs:
            params, num_new = seq.sampling_params, len(seq.token_ids)
            num_prompt = len(seq.prompt_token_ids)
            if params.pooling is not None and seq.start_pos < num_prompt:
                rows = hidden[offset : offset + min(num_new, num_prompt - seq.start_pos)].float()  # [R, hidden]
                if seq.start_pos == 0:
                    self._sums.pop(seq.request_id, None)
                if params.pooling == "mean":
                    total, count = self._sums.get(seq.request_id, (torch.zeros_like(rows[0]), 0))
                    self._sums[seq.request_id] = (total + rows.sum(dim=0), count + rows.shape[0])
                else:
                    self._sums[seq.request_id] = (rows[-1], 1)
                if seq.start_pos + num_new >= num_prompt:
                    total, count = self._sums.pop(seq.request_id)
                    pooled = total / count  # [hidden]
                    if params.normalize:
                        pooled = torch.nn.functional.normalize(pooled, dim=0)
                    done[seq.request_id] = pooled.tolist()
            offset += num_new
        return done
