"""Iteration-level scheduler (torch-free).

Each step spends a token budget: running requests first (a decode costs one
token, an unfinished prefill its next chunk), then waiting requests with
chunked prefill, shortest prompt first or in arrival order (``start_order``).
When a running request cannot get a block, the newest running request is
preempted by recompute. The result of a step is one
plain ``SchedulerOutput``; the model runner reads nothing else.
"""

from __future__ import annotations

import heapq
import itertools
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from shared.config import OVERTAKE_MAX_WAIT_S
from shared.engine.block_pool import KVBlock
from shared.engine.kv_cache_manager import KVCacheManager
from shared.engine.request import Request, RequestStatus, TokenSample
from shared.engine.sampling_params import SamplingParams


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 128
    max_model_len: int = 4096
    long_prefill_token_threshold: int = 0  # 0: a prefill chunk may take the whole budget
    scheduling_policy: str = "fcfs"  # or "shortest-first" (see Scheduler.start_order)


@dataclass
class ScheduledSeq:
    request_id: str
    token_ids: list[int]  # the new tokens to compute this step
    start_pos: int  # position of token_ids[0] (= num_computed_tokens before the step)
    block_ids: list[int]  # the request's whole block table
    # Requests that sample from this sequence's last logits: empty mid-prefill,
    # the request itself, plus its pending children when an n>1 request forks.
    sample_request_ids: list[str]
    sampling_params: SamplingParams
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    seed_offset: int = 0
    matchers: list[Any] = field(default_factory=list)  # per sample_request_ids: grammar matcher or None


@dataclass
class SchedulerOutput:
    seqs: list[ScheduledSeq] = field(default_factory=list)
    num_batched_tokens: int = 0
    block_copies: list[tuple[int, int]] = field(default_factory=list)  # (src, dst) before the forward
    preempted_ids: list[str] = field(default_factory=list)

    @property
    def is_empty(self) -> bool:
        return not self.seqs


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv_manager: KVCacheManager) -> None:
        self.config = config
        self.kv = kv_manager
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.num_preemptions = 0

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running)

    def add_request(self, request: Request) -> None:
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def add_running(self, request: Request) -> None:
        """Join a request whose KV is already in its blocks (remote prefill)."""
        self.requests[request.request_id] = request
        request.status = RequestStatus.RUNNING
        if request.scheduled_time is None:
            request.scheduled_time = time.monotonic()
        self.running.append(request)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        preempted_any = False
        for request in list(self.running):
            if budget <= 0:
                break
            if request.status != RequestStatus.RUNNING:
                continue  # preempted earlier in this loop
            num_new = self._num_new_tokens(request, budget)
            while True:
                block_ids = self.kv.allocate_slots(request, num_new)
                if block_ids is not None:
                    break
                victim = self.running[-1]
                self._preempt(victim, out)
                preempted_any = True
                if victim is request:
                    break
            if block_ids is None:
                continue
            self._emit(out, request, num_new, block_ids)
            budget -= num_new
        if not preempted_any:
            budget = self._schedule_waiting(out, budget)
        out.num_batched_tokens = self.config.max_num_batched_tokens - budget
        out.block_copies = self.kv.take_pending_copies()
        return out

    def start_order(self, now: float, limit: int) -> list[Request]:
        """Up to ``limit`` waiting requests in the order they may start. Preempted requests first (they were
        running; preemption puts them at the front); then, under "fcfs", the others as they arrived; under
        "shortest-first", those that have waited OVERTAKE_MAX_WAIT_S as they arrived, then the rest shortest
        prompt first (the first to arrive among equals; a cached prefix is not counted off, it is looked up
        only for a request that starts). Under a burst, a prompt of 30 tokens then waits for the prompts
        shorter than it, not for the 500-token ones that arrived a moment before it: the burst's median time
        to first token falls by about a third and its total work stays the same. One pass over the queue a
        step (``heapq.nsmallest``), whatever its length: an offline batch queues all its prompts at once."""
        waiting = self.waiting
        if self.config.scheduling_policy == "fcfs":
            return list(itertools.islice(waiting, limit))
        front = 0  # waiting holds the preempted, then the rest in arrival order
        while (
            front < len(waiting)
            and front < limit
            and (
                waiting[front].status != RequestStatus.WAITING
                or now - waiting[front].arrival_time >= OVERTAKE_MAX_WAIT_S
            )
        ):
            front += 1
        order = list(itertools.islice(waiting, front))
        rest = itertools.islice(waiting, front, None)
        return order + heapq.nsmallest(limit - front, rest, key=lambda r: r.num_tokens)  # stable among equals

    def _schedule_waiting(self, out: SchedulerOutput, budget: int) -> int:
        limit = min(self.config.max_num_seqs - len(self.running), budget)
        if not self.waiting or limit <= 0:
            return budget
        started: list[Request] = []
        for request in self.start_order(time.monotonic(), limit):  # limit: the free sequence slots at most
            if budget <= 0:
                break
            hits: list[KVBlock] = []
            num_hit_tokens = 0
            if request.num_computed_tokens == 0:
                hits, num_hit_tokens = self.kv.get_computed_blocks(request)
            request.num_computed_tokens = num_hit_tokens
            num_new = self._num_new_tokens(request, budget)
            block_ids = self.kv.allocate_slots(request, num_new, hits)
            if block_ids is None:
                request.num_computed_tokens = 0
                break
            started.append(request)
            if request.status == RequestStatus.WAITING:
                request.num_cached_tokens = num_hit_tokens
            if request.scheduled_time is None:
                request.scheduled_time = time.monotonic()
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            self._emit(out, request, num_new, block_ids)
            budget -= num_new
        self._remove_waiting(started)
        return budget

    def _remove_waiting(self, requests: list[Request]) -> None:
        """Take ``requests`` out of ``waiting``: from the front one by one (arrival order starts a prefix of
        it), else in one pass."""
        ids = {id(r) for r in requests}
        while ids and self.waiting and id(self.waiting[0]) in ids:
            ids.discard(id(self.waiting.popleft()))
        if ids:
            kept = [r for r in self.waiting if id(r) not in ids]
            self.waiting.clear()
            self.waiting.extend(kept)

    def _num_new_tokens(self, request: Request, budget: int) -> int:
        num_new = request.num_tokens - request.num_computed_tokens
        threshold = self.config.long_prefill_token_threshold
        if threshold and num_new > threshold:
            num_new = threshold
        return min(num_new, budget)

    def _emit(self, out: SchedulerOutput, request: Request, num_new: int, block_ids: list[int]) -> None:
        start = request.num_computed_tokens
        completes = start + num_new == len(request.token_ids)
        samplers = [request, *request.pending_children] if completes else []
        sample_ids = [r.request_id for r in samplers]
        out.seqs.append(
            ScheduledSeq(
                request_id=request.request_id,
                token_ids=request.token_ids[start : start + num_new],
                start_pos=start,
                block_ids=block_ids,
                sample_request_ids=sample_ids,
                sampling_params=request.sampling_params,
                prompt_token_ids=request.prompt_token_ids,
                output_token_ids=request.output_token_ids,
                seed_offset=request.seed_offset,
                matchers=[r.matcher for r in samplers],
            )
        )

    def _preempt(self, request: Request, out: SchedulerOutput) -> None:
        self.running.remove(request)
        self.kv.free(request.request_id)
        request.num_computed_tokens = 0
        request.status = RequestStatus.PREEMPTED
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(request)
        out.preempted_ids.append(request.request_id)
        out.seqs = [s for s in out.seqs if s.request_id != request.request_id]

    def update_from_output(
        self, out: SchedulerOutput, sampled: dict[str, list[TokenSample]]
    ) -> list[tuple[Request, TokenSample]]:
        """Advance computed counts, append sampled tokens, finish requests.

        ``sampled`` maps request id to its samples (n for a forking request:
        one for itself, one per pending child). Returns each request that got
        a token (children included) with its sample.
        """
        results: list[tuple[Request, TokenSample]] = []
        for seq in out.seqs:
            request = self.requests.get(seq.request_id)
            if request is None or request.status != RequestStatus.RUNNING:
                continue  # aborted while the step ran
            request.num_computed_tokens += len(seq.token_ids)
            self.kv.cache_full_blocks(request)
            samples = sampled.get(seq.request_id)
            if not samples:
                continue
            targets = [request]
            if request.pending_children:
                targets += self._fork(request)
            for target, sample in zip(targets, samples, strict=True):
                target.append_output_token(sample.token_id)
                status = target.check_stop(sample.token_id)
                results.append((target, sample))
                if status is not None:
                    self.finish(target, status)
        return results

    def _fork(self, parent: Request) -> list[Request]:
        children, parent.pending_children = parent.pending_children, []
        for child in children:
            child.num_computed_tokens = parent.num_computed_tokens
            child.num_cached_tokens = parent.num_cached_tokens
            self.kv.fork(parent, child)
            self.add_running(child)
        return children

    def finish(self, request: Request, status: RequestStatus) -> None:
        request.status = status
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        self.requests.pop(request.request_id, None)
        if status != RequestStatus.FINISHED_PREFILLED:
            self.kv.free(request.request_id)
        for child in request.pending_children:
            child.status = status
        request.pending_children = []

    def abort(self, request_id: str) -> Request | None:
        request = self.requests.get(request_id)
        if request is None:
            return None
        self.finish(request, RequestStatus.FINISHED_ABORTED)
        return request
