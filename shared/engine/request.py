"""A request's state inside the engine (torch-free).

Only two numbers drive scheduling: ``num_computed_tokens`` (KV already in
the cache) and ``num_tokens`` (prompt + generated). Prefill, chunked prefill,
prefix-cache hits, remote KV and decode all follow from them.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Any

from shared.engine.prefix_hash import ROOT_HASH, block_hashes
from shared.engine.sampling_params import SamplingParams


@dataclass
class TokenSample:
    """One sampled token with its logprob and, if asked for, the top alternatives."""

    token_id: int
    logprob: float = 0.0
    top_logprobs: list[tuple[int, float]] | None = None
    rank: int | None = None  # 1 = the most likely token; set for prompt logprobs


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"
    # Prefill role: the first token is sampled and the blocks stay held for a decode worker to pull.
    FINISHED_PREFILLED = "prefilled"

    @property
    def is_finished(self) -> bool:
        return self not in (RequestStatus.WAITING, RequestStatus.RUNNING, RequestStatus.PREEMPTED)


@dataclass(eq=False)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_ids: frozenset[int] = frozenset()
    max_model_len: int = 1 << 30
    arrival_time: float = field(default_factory=time.monotonic)
    seed_offset: int = 0  # child i of an n>1 request samples with seed + i
    parent_request_id: str | None = None  # set on the children of an n>1 request
    output_token_ids: list[int] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache at first schedule
    num_preemptions: int = 0
    scheduled_time: float | None = None  # monotonic time of its first schedule (ends the queue time)
    status: RequestStatus = RequestStatus.WAITING
    # Block hashes of the full blocks of token_ids, extended lazily.
    _block_hashes: list[bytes] = field(default_factory=list)
    # Children created when an n>1 request finishes its prefill.
    pending_children: list[Request] = field(default_factory=list)
    # Prefill role: finish after the first token, keeping the blocks until released.
    prefill_only: bool = False
    kv_lease_seconds: float = 30.0  # prefill role: how long the finished prefill's lease lasts
    # With sampling_params.prompt_logprobs: the scores of prompt tokens 1.. (shared.engine.prompt_logprobs).
    prompt_logprobs: list[TokenSample] = field(default_factory=list)
    # Structured output: the grammar matcher (xgrammar), advanced by every appended token.
    matcher: Any = None

    def __post_init__(self) -> None:
        if not self.token_ids:
            self.token_ids = list(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def max_tokens(self) -> int:
        limit = self.max_model_len - len(self.prompt_token_ids)
        max_tokens = self.sampling_params.max_tokens
        return limit if max_tokens is None or max_tokens > limit else max_tokens

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    def append_output_token(self, token_id: int) -> bool:
        """Append a generated token; False if the request's grammar does not allow it."""
        self.output_token_ids.append(token_id)
        self.token_ids.append(token_id)
        if self.matcher is not None and not self.matcher.is_terminated():
            return bool(self.matcher.accept_token(token_id))
        return True

    def block_hashes(self, block_size: int) -> list[bytes]:
        """Chained hashes of every full block of ``token_ids`` (cached incrementally)."""
        done = len(self._block_hashes)
        if (done + 1) * block_size <= self.num_tokens:
            parent = self._block_hashes[-1] if done else ROOT_HASH
            self._block_hashes.extend(block_hashes(self.token_ids, block_size, parent, start_block=done))
        return self._block_hashes

    def check_stop(self, token_id: int) -> RequestStatus | None:
        """Finish status after ``token_id`` was appended, or None to keep going."""
        params = self.sampling_params
        num_output = len(self.output_token_ids)  # (runs for every token: no property calls)
        if num_output >= params.min_tokens:
            if not params.ignore_eos and token_id in self.eos_token_ids:
                return RequestStatus.FINISHED_STOPPED
            if token_id in params.stop_token_ids:
                return RequestStatus.FINISHED_STOPPED
        if self.matcher is not None and self.matcher.is_terminated():
            return RequestStatus.FINISHED_STOPPED  # the grammar is complete
        if num_output >= self.max_tokens or len(self.token_ids) >= self.max_model_len:
            return RequestStatus.FINISHED_LENGTH
        return RequestStatus.FINISHED_PREFILLED if self.prefill_only else None
