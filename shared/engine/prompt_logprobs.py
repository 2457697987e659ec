"""Logprobs of the prompt's own tokens, computed where the prompt is computed.

For a request with ``prompt_logprobs=k``, every prefill step that computes
prompt positions ``p`` also scores the next prompt token ``prompt[p + 1]``
under the model's raw distribution at ``p`` (no penalties, no temperature, as
transformers' ``log_softmax(logits)``), with its rank and the ``k`` most likely
tokens. Chunked prefill scores chunk by chunk; a recompute after preemption
does not score a position twice. Such requests skip the prefix cache (a cached
block has no logits).
"""

from __future__ import annotations

import torch
from torch import Tensor

from shared.engine.request import TokenSample
from shared.engine.scheduler import SchedulerOutput
from shared.kernels import cpu_kernels


def prompt_rows(sched: SchedulerOutput) -> tuple[list[int], list[int], list[tuple[str, int, int, int]]]:
    """Hidden-state rows to score, their target token ids, and per request (id, first position, count, k)."""
    rows: list[int] = []
    targets: list[int] = []
    spans: list[tuple[str, int, int, int]] = []
    offset = 0
    for seq in sched.seqs:
        k = seq.sampling_params.prompt_logprobs
        num_prompt = len(seq.prompt_token_ids)
        if k is not None and seq.start_pos < num_prompt - 1:
            end = min(seq.start_pos + len(seq.token_ids), num_prompt - 1)  # the last prompt position predicts output
            positions = range(seq.start_pos, end)
            rows += [offset + p - seq.start_pos for p in positions]
            targets += [seq.prompt_token_ids[p + 1] for p in positions]
            spans.append((seq.request_id, seq.start_pos + 1, len(positions), k))
        offset += len(seq.token_ids)
    return rows, targets, spans


def score_prompt(logits: Tensor, targets: Tensor, max_k: int) -> tuple[Tensor, Tensor, Tensor | None, Tensor | None]:
    """logits [R, V] -> logprob [R] and rank [R] of each target, and the top ``max_k`` ids/logprobs [R, K]."""
    if logits.device.type == "cpu":
        # One pass per row (csrc/sample.c) instead of a log_softmax, a comparison and a topk over [R, V].
        native = cpu_kernels.prompt_logprobs(logits, targets, min(max_k, logits.shape[-1]))
        if native is not None:
            chosen, ranks, ids, values = native
            return (chosen, ranks, ids, values) if max_k > 0 else (chosen, ranks, None, None)
    logprobs = logits.log_softmax(dim=-1)  # [R, V]
    target_lp = logprobs.gather(1, targets.unsqueeze(1))  # [R, 1]
    rank = (logprobs > target_lp).sum(dim=-1) + 1  # [R], 1 = most likely
    top_lp = top_ids = None
    if max_k > 0:
        top_lp, top_ids = logprobs.topk(min(max_k, logprobs.shape[-1]), dim=-1)  # [R, K]
    return target_lp.squeeze(1), rank, top_ids, top_lp


def compute_prompt_logprobs(
    hidden: Tensor, sched: SchedulerOutput, compute_logits
) -> dict[str, tuple[int, list[TokenSample]]]:
    """Per request with prompt logprobs in this step: (prompt position of the first sample, samples)."""
    rows, targets, spans = prompt_rows(sched)
    if not rows:
        return {}
    device = hidden.device
    logits = compute_logits(hidden[torch.tensor(rows, device=device)])  # [R, V]
    max_k = max(k for *_, k in spans)
    target_lp, rank, top_ids, top_lp = score_prompt(logits, torch.tensor(targets, device=device), max_k)
    lp_list, rank_list = target_lp.tolist(), rank.tolist()
    ids_list = top_ids.tolist() if top_ids is not None else None
    tops_list = top_lp.tolist() if top_lp is not None else None
    out: dict[str, tuple[int, list[TokenSample]]] = {}
    row = 0
    for request_id, first_position, count, k in spans:
        samples = []
        for i in range(row, row + count):
            top = None
            if ids_list is not None and tops_list is not None and k > 0:
                top = list(zip(ids_list[i][:k], tops_list[i][:k], strict=True))
            samples.append(TokenSample(targets[i], lp_list[i], top, rank=rank_list[i]))
        out[request_id] = (first_position, samples)
        row += count
    return out


def record(prompt_logprobs: list[TokenSample], first_position: int, samples: list[TokenSample]) -> None:
    """Append samples for prompt positions ``first_position..``, skipping positions already scored."""
    for position, sample in enumerate(samples, start=first_position):
        if position == len(prompt_logprobs) + 1:  # position 0 has no logprob
            prompt_logprobs.append(sample)
