"""Prometheus metrics of the router (``cleave_router_*``), one registry per app."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

# Latency buckets in seconds, spanning sub-millisecond ITL to multi-minute generations.
_TTFT_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0)
_ITL_BUCKETS = (0.001, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 1.0, 2.5)
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
            "Finished choices by finish reason (stop, length, abort, error).",
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
        self.running = Gauge("cleave_router_requests_running", "HTTP generation requests in flight.", registry=r)
        self.worker_healthy = Gauge(
            "cleave_router_worker_healthy",
            "1 when the last health poll of a worker succeeded, else 0.",
            ["role", "address"],
            registry=r,
        )

    def render(self) -> bytes:
        return generate_latest(self.registry)
