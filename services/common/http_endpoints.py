"""A worker's HTTP side: Prometheus ``/metrics`` and ``/health`` on the metrics port.

``/health`` answers 200 ``{"status": "ok"}`` or 503 with the reason (draining,
engine stopped), for Kubernetes probes and compose health checks, which speak
HTTP rather than the workers' gRPC.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable
from socketserver import ThreadingMixIn
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import REGISTRY, CollectorRegistry, make_wsgi_app

HealthCheck = Callable[[], str | None]  # None when healthy, else the reason


class _ThreadingServer(ThreadingMixIn, WSGIServer):
    daemon_threads = True


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format, *args) -> None:  # probes every few seconds: no access log
        pass


def start_metrics_server(
    host: str, port: int, health: HealthCheck, registry: CollectorRegistry = REGISTRY
) -> WSGIServer:
    """Serve ``/health`` and ``/metrics`` in a daemon thread; ``server.server_port`` is the bound port."""
    metrics_app = make_wsgi_app(registry)

    def app(environ, start_response):
        if environ.get("PATH_INFO") != "/health":
            return metrics_app(environ, start_response)
        reason = health()
        body = json.dumps({"status": "ok" if reason is None else reason}).encode()
        status = "200 OK" if reason is None else "503 Service Unavailable"
        start_response(status, [("Content-Type", "application/json"), ("Content-Length", str(len(body)))])
        return [body]

    server = make_server(host, port, app, server_class=_ThreadingServer, handler_class=_QuietHandler)
    threading.Thread(target=server.serve_forever, name="metrics-http", daemon=True).start()
    return server
