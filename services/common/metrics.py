"""Prometheus metrics of a worker process (``cleave_*``), in the worker's own registry.

Names and meanings follow vLLM V1's ``vllm:*`` set (README, "Metrics"), so
dashboards and endpoint pickers built for vLLM map one to one. Every series
carries ``role`` (prefill or decode) and ``worker_id``; Prometheus adds
``instance``. Engine figures are read from ``EngineCore.stats()`` once a
second; per-request histograms are observed by ``RequestTracker`` as deltas
stream out; tokens per step by the engine's ``on_step`` hook.
"""

from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from shared.engine.engine_core import EngineStats, RequestOutputDelta
from shared.engine.request import Request

# Seconds: sub-millisecond inter-token gaps up to multi-minute generations (vLLM's buckets).
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0)
ITL_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 1.0, 2.5)
LATENCY_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 60.0, 120.0, 240.0, 480.0)
KV_TRANSFER_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
TOKEN_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768)

LABELS = ("role", "worker_id")


class WorkerMetrics:
    """All series of one worker process; ``render()`` is the /metrics body."""

    def __init__(self, role: str, worker_id: str, *, block_size: int, num_blocks: int, backend: str) -> None:
        self.registry = CollectorRegistry()
        self.block_size = block_size
        self._values = {"role": role, "worker_id": worker_id}
        r = self.registry

        def gauge(name: str, doc: str):
            return Gauge(name, doc, LABELS, registry=r).labels(**self._values)

        def counter(name: str, doc: str):
            return Counter(name, doc, LABELS, registry=r).labels(**self._values)

        def histogram(name: str, doc: str, buckets):
            return Histogram(name, doc, LABELS, buckets=buckets, registry=r).labels(**self._values)

        # Scheduler state (also the gauges a Gateway API Inference Extension endpoint picker reads).
        self.running = gauge("cleave_num_requests_running", "Requests in the running batch.")
        self.waiting = gauge("cleave_num_requests_waiting", "Requests waiting to be scheduled (the queue).")
        self.kv_usage = gauge("cleave_kv_cache_usage_perc", "Fraction of KV cache blocks in use (0-1).")
        self.free_blocks = gauge("cleave_kv_cache_free_blocks", "KV cache blocks free or evictable.")
        info = Gauge("cleave_cache_config_info", "KV cache configuration (value 1).",
                     [*LABELS, "block_size", "num_gpu_blocks"], registry=r)  # fmt: skip
        info.labels(**self._values, block_size=str(block_size), num_gpu_blocks=str(num_blocks)).set(1)
        # Engine counters.
        self.prefix_queries = counter("cleave_prefix_cache_queries", "Prompt tokens looked up in the prefix cache.")
        self.prefix_hits = counter("cleave_prefix_cache_hits", "Prompt tokens found in the prefix cache.")
        self.preemptions = counter("cleave_num_preemptions", "Requests preempted by recompute.")
        self.prompt_tokens = counter("cleave_prompt_tokens", "Prompt tokens computed (prefix-cache hits excluded).")
        self.generation_tokens = counter("cleave_generation_tokens", "Tokens generated.")
        self.request_success = Counter("cleave_request_success", "Finished requests by finish reason.",
                                       [*LABELS, "finished_reason"], registry=r)  # fmt: skip
        # Per-request histograms.
        self.ttft = histogram("cleave_time_to_first_token_seconds", "Request arrival to first token.", TTFT_BUCKETS)
        self.itl = histogram("cleave_inter_token_latency_seconds", "Time between consecutive tokens.", ITL_BUCKETS)
        self.tpot = histogram("cleave_request_time_per_output_token_seconds",
                              "Mean time per output token after the first, per request.", ITL_BUCKETS)  # fmt: skip
        self.e2e = histogram("cleave_e2e_request_latency_seconds", "Request arrival to finish.", LATENCY_BUCKETS)
        self.queue_time = histogram("cleave_request_queue_time_seconds",
                                    "Time waiting before the first schedule.", LATENCY_BUCKETS)  # fmt: skip
        self.prefill_time = histogram("cleave_request_prefill_time_seconds",
                                      "First schedule to first token.", LATENCY_BUCKETS)  # fmt: skip
        self.decode_time = histogram("cleave_request_decode_time_seconds",
                                     "First token to last token.", LATENCY_BUCKETS)  # fmt: skip
        self.prompt_len = histogram("cleave_request_prompt_tokens", "Prompt length of finished requests.",
                                    TOKEN_BUCKETS)  # fmt: skip
        self.generation_len = histogram("cleave_request_generation_tokens", "Generated tokens of finished requests.",
                                        TOKEN_BUCKETS)  # fmt: skip
        self.step_tokens = histogram("cleave_iteration_tokens", "Tokens batched per engine step.", TOKEN_BUCKETS)
        # KV transfer between workers.
        self.kv_bytes = counter("cleave_kv_transfer_bytes", "KV cache bytes pulled from prefill workers.")
        self.kv_local_bytes = counter("cleave_kv_local_read_bytes",
                                      "Of those bytes, the ones read straight from the memory of a prefill worker "
                                      "on this machine (no transfer backend).")  # fmt: skip
        self.kv_seconds = histogram("cleave_kv_transfer_seconds", "Duration of one KV pull.", KV_TRANSFER_BUCKETS)
        self.kv_descriptors = counter("cleave_kv_transfer_descriptors", "Transfer descriptors of KV pulls.")
        self.kv_transfers = counter("cleave_kv_transfers", "KV pulls completed.")
        self.kv_failures = counter("cleave_kv_transfer_failures", "KV pulls that failed (incl. expired leases).")
        self.kv_pull_cached = counter("cleave_kv_pull_cached_tokens",
                                      "Prompt tokens of KV pulls found in this worker's prefix cache, so not pulled.")  # fmt: skip
        self.kv_recomputes = counter("cleave_kv_recomputes", "Requests whose prefill was recomputed after a failure.")
        self.lease_expired = counter("cleave_kv_lease_expired", "KV leases that expired before release.")
        self.leased = gauge("cleave_kv_leased_requests", "Finished prefills whose blocks wait for a pull.")
        backend_info = Gauge("cleave_kv_transfer_backend_info", "KV transfer backend in use (value 1).",
                             [*LABELS, "backend"], registry=r)  # fmt: skip
        backend_info.labels(**self._values, backend=backend).set(1)
        # Structured output.
        self.structured_requests = counter("cleave_structured_output_requests", "Requests with an output constraint.")
        self.grammar_compiles = counter(
            "cleave_grammar_compiles", "Output constraints compiled (grammar cache misses)."
        )
        self.grammar_compile_seconds = counter("cleave_grammar_compile_seconds", "Seconds spent compiling grammars.")
        self._last: dict[str, int] = {}

    def render(self) -> bytes:
        return generate_latest(self.registry)

    def _advance(self, counter, key: str, total: int) -> None:
        delta = total - self._last.get(key, 0)
        if delta > 0:
            counter.inc(delta)
        self._last[key] = total

    def update(self, stats: EngineStats, num_leased: int, kv_local_bytes: int = 0) -> None:
        """Copy an engine snapshot into the gauges and counters."""
        self.running.set(stats.num_running)
        self.waiting.set(stats.num_waiting)
        self.kv_usage.set(stats.kv_cache_usage)
        self.free_blocks.set(stats.num_free_blocks)
        self.leased.set(num_leased)
        self._advance(self.prefix_queries, "q", stats.prefix_cache_queries * self.block_size)
        self._advance(self.prefix_hits, "h", stats.prefix_cache_hits * self.block_size)
        self._advance(self.preemptions, "p", stats.num_preemptions)
        self._advance(self.prompt_tokens, "pt", stats.num_prompt_tokens_computed)
        self._advance(self.generation_tokens, "gt", stats.num_generation_tokens)
        self._advance(self.lease_expired, "le", stats.num_leases_expired)
        self._advance(self.kv_pull_cached, "kc", stats.num_pull_cached_tokens)
        self._advance(self.kv_local_bytes, "lb", kv_local_bytes)

    def observe_step(self, num_batched_tokens: int) -> None:
        if num_batched_tokens > 0:
            self.step_tokens.observe(num_batched_tokens)

    def observe_kv_pull(self, num_bytes: int, seconds: float, num_descriptors: int) -> None:
        self.kv_bytes.inc(num_bytes)
        self.kv_seconds.observe(seconds)
        self.kv_descriptors.inc(num_descriptors)
        self.kv_transfers.inc()

    def tracker(self, request: Request) -> RequestTracker:
        return RequestTracker(self, request)


class RequestTracker:
    """Latency bookkeeping of one request on this worker (all its samples when n > 1)."""

    def __init__(self, metrics: WorkerMetrics, request: Request) -> None:
        self.metrics = metrics
        self.request = request
        self.first_token_at: float | None = None
        self._last_at: dict[int, float] = {}
        self._first_at: dict[int, float] = {}
        self._num_tokens: dict[int, int] = {}
        self.finish_reasons: list[str] = []

    def on_delta(self, delta: RequestOutputDelta) -> None:
        now = time.monotonic()
        m, index, count = self.metrics, delta.sample_index, len(delta.new_token_ids)
        if count and self.first_token_at is None:
            self.first_token_at = now
            m.ttft.observe(now - self.request.arrival_time)
            scheduled = self.request.scheduled_time
            if scheduled is not None:
                m.queue_time.observe(max(scheduled - self.request.arrival_time, 0.0))
                m.prefill_time.observe(max(now - scheduled, 0.0))
        if count:
            last = self._last_at.get(index)
            if last is None:
                self._first_at[index] = now
            else:
                for _ in range(count):
                    m.itl.observe((now - last) / count)
            self._last_at[index] = now
            self._num_tokens[index] = self._num_tokens.get(index, 0) + count
        if delta.finished:
            self._finish(index, delta, now)

    def _finish(self, index: int, delta: RequestOutputDelta, now: float) -> None:
        m = self.metrics
        reason = delta.finish_reason or "stop"
        self.finish_reasons.append(reason)
        m.request_success.labels(**m._values, finished_reason=reason).inc()
        m.e2e.observe(now - self.request.arrival_time)
        m.prompt_len.observe(delta.num_prompt_tokens)
        num_tokens = self._num_tokens.get(index, 0)
        m.generation_len.observe(num_tokens)
        first, last = self._first_at.get(index), self._last_at.get(index)
        if first is not None and last is not None:
            m.decode_time.observe(last - first)
            if num_tokens > 1:
                m.tpot.observe((last - first) / (num_tokens - 1))
