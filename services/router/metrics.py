"""Prometheus metrics of the router (``cleave_router_*``), one registry per app."""

from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.registry import Collector

ROLES = ("prefill", "decode")
MIGRATION_OUTCOMES = ("migrated", "refused", "no_worker")

# Latency buckets in seconds, spanning sub-millisecond ITL to multi-minute generations.
_TTFT_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0)
_ITL_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 1.0, 2.5)
_E2E_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0)


class RouterMetrics:
    """All router series; pass ``registry`` to keep several apps apart (tests)."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "cleave_router_requests_total",
            "Finished HTTP requests by endpoint and HTTP status code.",
            ["endpoint", "status"],
            registry=r,
        )
        self.finished_sequences = Counter(
            "cleave_router_finished_sequences_total",
            "Choices that finished normally, by finish reason (stop or length).",
            ["finish_reason"],
            registry=r,
        )
        self.routed = Counter(
            "cleave_router_routed_sequences_total",
            "Choices sent to workers, by path (disaggregated or aggregated).",
            ["path"],
            registry=r,
        )
        self.ttft = Histogram(
            "cleave_router_time_to_first_token_seconds",
            "Time from request arrival to the first generated token.",
            buckets=_TTFT_BUCKETS,
            registry=r,
        )
        self.tpot = Histogram(
            "cleave_router_time_per_output_token_seconds",
            "Mean time per output token after the first, per choice.",
            buckets=_ITL_BUCKETS,
            registry=r,
        )
        self.itl = Histogram(
            "cleave_router_inter_token_latency_seconds",
            "Time between consecutive output tokens as seen by the router.",
            buckets=_ITL_BUCKETS,
            registry=r,
        )
        self.e2e = Histogram(
            "cleave_router_e2e_request_latency_seconds",
            "Time from request arrival to the last token of the request.",
            buckets=_E2E_BUCKETS,
            registry=r,
        )
        self.prompt_tokens = Counter(
            "cleave_router_prompt_tokens_total", "Prompt tokens of finished requests.", registry=r
        )
        self.generation_tokens = Counter(
            "cleave_router_generation_tokens_total", "Generated tokens of finished requests.", registry=r
        )
        self.routing_decisions = Counter(
            "cleave_router_routing_decisions_total",
            "Worker picks by pool role, routing policy and outcome (picked or no_worker).",
            ["role", "policy", "outcome"],
            registry=r,
        )
        self.running = Gauge("cleave_router_requests_running", "HTTP generation requests in flight.", registry=r)
        self.worker_healthy = Gauge(
            "cleave_router_worker_healthy",
            "1 when the last health poll of a worker succeeded, else 0.",
            ["role", "address"],
            registry=r,
        )
        self._add_control_plane(r)
        self._state_collector: Collector | None = None

    def _add_control_plane(self, r: CollectorRegistry) -> None:
        """Retries, migrations, backpressure and deadlines; every label set starts at 0 so that a
        dashboard shows a flat line, not "no data", until the first event."""
        self.retries = Counter(
            "cleave_router_retries_total",
            "Worker calls sent to another worker of the pool after the first one was unreachable, by pool role.",
            ["role"],
            registry=r,
        )
        self.migrations = Counter(
            "cleave_router_migrations_total",
            "Decode streams that broke mid-generation, by outcome: migrated (resumed on another decode worker), "
            "refused (--migration-limit reached, or a forked n>1 request), no_worker (no other decode worker).",
            ["outcome"],
            registry=r,
        )
        self.rejected = Counter(
            "cleave_router_rejected_requests_total",
            "Requests answered 429 because every healthy worker of a pool had --max-queued-requests calls open.",
            ["role"],
            registry=r,
        )
        self.timeouts = Counter(
            "cleave_router_request_timeouts_total",
            "Requests that ran longer than --request-timeout (answered 504 or ended by an error event).",
            registry=r,
        )
        for role in ROLES:
            self.retries.labels(role)
            self.rejected.labels(role)
        for outcome in MIGRATION_OUTCOMES:
            self.migrations.labels(outcome)

    def watch_state(self, collector: Collector) -> None:
        """Serve the series ``collector`` reads from the router's state (one at a time)."""
        if self._state_collector is not None:
            self.registry.unregister(self._state_collector)
        self._state_collector = collector
        self.registry.register(collector)

    def render(self) -> bytes:
        return generate_latest(self.registry)


class RequestTimer:
    """Latency bookkeeping of one HTTP request (all its choices); observes on ``finish``."""

    def __init__(self, metrics: RouterMetrics) -> None:
        self.metrics = metrics
        self.start = time.perf_counter()
        self.first_token_at: float | None = None
        self._first_at: dict[int, float] = {}
        self._last_at: dict[int, float] = {}
        self._num_tokens: dict[int, int] = {}

    def on_tokens(self, index: int, num_tokens: int) -> None:
        if num_tokens <= 0:
            return
        now = time.perf_counter()
        if self.first_token_at is None:
            self.first_token_at = now
            self.metrics.ttft.observe(now - self.start)
        last = self._last_at.get(index)
        if last is None:
            self._first_at[index] = now
        else:
            # Tokens arriving in one message split the gap since the previous message evenly.
            gap = (now - last) / num_tokens
            for _ in range(num_tokens):
                self.metrics.itl.observe(gap)
        self._last_at[index] = now
        self._num_tokens[index] = self._num_tokens.get(index, 0) + num_tokens

    @property
    def ttft_s(self) -> float | None:
        return None if self.first_token_at is None else self.first_token_at - self.start

    def elapsed_s(self) -> float:
        return time.perf_counter() - self.start

    def finish(self, num_prompt_tokens: int, num_generated_tokens: int) -> float:
        """Observe e2e latency, TPOT and token counters; returns the e2e latency."""
        e2e = self.elapsed_s()
        self.metrics.e2e.observe(e2e)
        for index, count in self._num_tokens.items():
            if count > 1:
                self.metrics.tpot.observe((self._last_at[index] - self._first_at[index]) / (count - 1))
        self.metrics.prompt_tokens.inc(num_prompt_tokens)
        self.metrics.generation_tokens.inc(num_generated_tokens)
        return e2e
