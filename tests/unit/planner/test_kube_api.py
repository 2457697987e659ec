"""The planner's Kubernetes API calls, against a local HTTP stand-in for the API server.

There is no Kubernetes cluster here: a small HTTP server plays the API server's
``deployments/{name}/scale`` endpoints (and Prometheus's query endpoint) and
records every request, so the test checks the paths, verbs and bodies the
official ``kubernetes`` client sends.
"""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, urlparse

import pytest
from kubernetes import client

from services.planner.__main__ import Pool, step
from services.planner.kube import DeploymentScaler
from services.planner.load import PrometheusLoad
from services.planner.policy import PoolPolicy

SCALE_PATH = "/apis/apps/v1/namespaces/llm/deployments/{}/scale"


class StandIn(BaseHTTPRequestHandler):
    replicas: dict[str, int] = {}
    latency: dict[str, str] = {}
    calls: list[tuple[str, str, str, dict | None]] = []

    def log_message(self, format, *args) -> None:
        pass

    def _reply(self, code: int, body: dict) -> None:
        data = json.dumps(body).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _scale(self, name: str) -> dict:
        return {"apiVersion": "autoscaling/v1", "kind": "Scale", "metadata": {"name": name, "namespace": "llm"},
                "spec": {"replicas": self.replicas[name]}, "status": {"replicas": self.replicas[name]}}  # fmt: skip

    def _deployment(self) -> str | None:
        for name in self.replicas:
            if self.path == SCALE_PATH.format(name):
                return name
        return None

    def do_GET(self) -> None:
        url = urlparse(self.path)
        if url.path == "/api/v1/query":
            query = parse_qs(url.query)["query"][0]
            key = "ttft" if "time_to_first_token" in query else "itl"
            value = self.latency.get(key)
            result = [] if value is None else [{"metric": {}, "value": [0, value]}]
            return self._reply(200, {"status": "success", "data": {"resultType": "vector", "result": result}})
        name = self._deployment()
        self.calls.append(("GET", self.path, "", None))
        if name is None:
            return self._reply(404, {"kind": "Status", "code": 404})
        self._reply(200, self._scale(name))

    def do_PATCH(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self.calls.append(("PATCH", self.path, self.headers["Content-Type"], body))
        name = self._deployment()
        if name is None:
            return self._reply(404, {"kind": "Status", "code": 404})
        self.replicas[name] = body["spec"]["replicas"]
        self._reply(200, self._scale(name))


@pytest.fixture
def api_server():
    StandIn.replicas = {"cleave-prefill": 1, "cleave-decode": 2}
    StandIn.latency = {}
    StandIn.calls = []
    server = ThreadingHTTPServer(("127.0.0.1", 0), StandIn)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_port}"
    server.shutdown()
    server.server_close()


def _scaler(base: str) -> DeploymentScaler:
    configuration = client.Configuration(host=base)
    return DeploymentScaler(client.ApiClient(configuration), "llm")


def test_reads_and_patches_the_scale_subresource(api_server: str) -> None:
    scaler = _scaler(api_server)
    assert scaler.replicas("cleave-decode") == 2
    scaler.set_replicas("cleave-decode", 4)
    assert StandIn.replicas["cleave-decode"] == 4
    (get, patch) = StandIn.calls
    assert get[:2] == ("GET", SCALE_PATH.format("cleave-decode"))
    assert patch[0] == "PATCH" and patch[1] == SCALE_PATH.format("cleave-decode")
    assert patch[2].startswith("application/") and patch[2].endswith("patch+json")
    assert patch[3] == {"spec": {"replicas": 4}}


def test_planner_steps_scale_decode_on_sustained_itl_breach(api_server: str) -> None:
    load = PrometheusLoad(api_server)
    pools = [
        Pool("cleave-prefill", PoolPolicy(1.0, 1, 4, cooldown_s=60), load.ttft_s),
        Pool("cleave-decode", PoolPolicy(0.05, 1, 8, cooldown_s=60), load.itl_s),
    ]
    scaler = _scaler(api_server)
    StandIn.latency = {"ttft": "0.4", "itl": "0.12"}
    for now in (0.0, 30.0):
        step(pools, scaler, now, dry_run=False)
    assert not [c for c in StandIn.calls if c[0] == "PATCH"]  # two breaching samples: not yet sustained
    step(pools, scaler, 60.0, dry_run=False)
    patches = [c for c in StandIn.calls if c[0] == "PATCH"]
    assert [(p[1], p[3]) for p in patches] == [
        (SCALE_PATH.format("cleave-decode"), {"spec": {"replicas": 5}})
    ]  # 2 x 0.12/0.05, rounded up
    step(pools, scaler, 90.0, dry_run=False)  # cooldown: no second change
    assert len([c for c in StandIn.calls if c[0] == "PATCH"]) == 1


def test_dry_run_reads_but_never_patches(api_server: str) -> None:
    load = PrometheusLoad(api_server)
    pools = [Pool("cleave-decode", PoolPolicy(0.05, 1, 8, cooldown_s=0), load.itl_s)]
    StandIn.latency = {"itl": "0.5"}
    wanted = [step(pools, _scaler(api_server), float(t), dry_run=True) for t in range(4)]
    assert wanted[-1] == {"cleave-decode": 6}
    assert StandIn.replicas["cleave-decode"] == 2
    assert {c[0] for c in StandIn.calls} == {"GET"}


def test_no_traffic_reads_as_none(api_server: str) -> None:
    assert PrometheusLoad(api_server).ttft_s() is None
