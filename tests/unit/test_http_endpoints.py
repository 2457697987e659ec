"""A worker's HTTP side on a real socket: /health follows the worker's state, /metrics stays Prometheus text."""

from __future__ import annotations

import json
import urllib.error
import urllib.request

from prometheus_client import CollectorRegistry, Counter

from services.common.http_endpoints import start_metrics_server


def _get(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=5) as resp:
            return resp.status, resp.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def test_health_and_metrics() -> None:
    registry = CollectorRegistry()
    Counter("cleave_test_events", "events", registry=registry).inc(3)
    state: dict[str, str | None] = {"reason": None}
    server = start_metrics_server("127.0.0.1", 0, lambda: state["reason"], registry)
    base = f"http://127.0.0.1:{server.server_port}"
    try:
        assert _get(base + "/health") == (200, json.dumps({"status": "ok"}))
        state["reason"] = "draining: the worker is shutting down"
        code, body = _get(base + "/health")
        assert code == 503 and json.loads(body) == {"status": "draining: the worker is shutting down"}
        code, body = _get(base + "/metrics")
        assert code == 200 and "cleave_test_events_total 3.0" in body
    finally:
        server.shutdown()
        server.server_close()
