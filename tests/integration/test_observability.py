"""What an operator sees of a real cluster (router + prefill + decode processes):
every /metrics endpoint passes Prometheus's own linter, every query of the
Grafana dashboard returns data from a real Prometheus scraping the cluster after
a short workload that includes a failed KV pull (workers found through a real
Redis, so the registry, Redis and KV index panels have data too), and one request is one
OpenTelemetry trace across the three processes (a local OTLP receiver)."""

from __future__ import annotations

import asyncio
import json
import shutil
import subprocess
import time
import urllib.request

import grpc
import openai
import pytest

from services.common.registry import connect, read_registry
from shared.genproto.cleave.v1 import worker_pb2 as pb
from shared.genproto.cleave.v1 import worker_pb2_grpc as pb_grpc
from shared.tools.gen_dashboards import DASHBOARD_PATH
from tests.helpers.redis_server import RedisServer
from tests.integration.cluster import scrape, start_router, start_worker, wait_worker
from tests.integration.otlp_receiver import OTLPReceiver
from tests.integration.prometheus import Prometheus

pytestmark = pytest.mark.slow

PROMPTS = ["the weather today", "once upon a time there was a garden", "hello", "a long story about the sea"]
LEASE_S = 3
# Grafana substitutes these; "All" of a multi-value variable is its allValue.
VARIABLES = {"$__rate_interval": "1m", "$pool": ".*", "$instance": ".*"}


def wait_discovered(base: str, timeout: float = 60) -> None:
    """Until the router has found a healthy worker of each pool in the registry."""
    deadline = time.monotonic() + timeout
    while True:
        with urllib.request.urlopen(base + "/health", timeout=5) as resp:
            health = json.loads(resp.read())
        if all(any(w["healthy"] for w in health[role]) for role in ("prefill", "decode")):
            return
        assert time.monotonic() < deadline, f"the router never discovered both workers: {health}"
        time.sleep(0.1)


@pytest.fixture(scope="module")
def cluster(model_dir, tmp_path_factory):
    receiver = OTLPReceiver()
    redis = RedisServer()
    redis.start()
    tracing = ["--otlp-traces-endpoint", receiver.endpoint, "--log-format", "json"]
    extra = ["--kv-transfer-backend", "tcp", "--redis-url", redis.url, *tracing]
    prefill = start_worker("prefill", model_dir, *extra, "--kv-lease-seconds", str(LEASE_S))
    decode = start_worker("decode", model_dir, *extra)
    procs = [prefill, decode]
    try:
        for p in procs:
            wait_worker(p)
        # Workers found through Redis, kv_aware routing (the default with Redis), every prompt disaggregated.
        router, base = start_router(model_dir, [], [], "--redis-url", redis.url, "--disagg-min-uncached-tokens", "0",
                                    *tracing)  # fmt: skip
        procs.append(router)
        wait_discovered(base)
        ports = {"router": base.rsplit(":", 1)[1], "prefill": prefill.info["metrics_port"],
                 "decode": decode.info["metrics_port"]}  # fmt: skip
        prom = Prometheus(tmp_path_factory.mktemp("prometheus"),
                          {f"cleave-{name}": [f"127.0.0.1:{port}"] for name, port in ports.items()})  # fmt: skip
        try:
            prom.wait_ready()
            prom.wait_scraping(len(ports))
            yield {"prefill": prefill, "decode": decode, "router": router, "base": base, "ports": ports, "prometheus": prom,
                   "receiver": receiver, "redis": redis}  # fmt: skip
        finally:
            prom.stop()
    finally:
        for p in procs:
            p.stop()
        receiver.stop()
        redis.stop()


def sampling() -> pb.SamplingParams:
    return pb.SamplingParams(n=1, temperature=0.0, top_p=1.0, repetition_penalty=1.0, max_tokens=4, ignore_eos=True)


def failed_kv_pull(cluster) -> None:
    """Prefill directly, let the lease expire, then ask the decode worker to pull: it recomputes."""
    prompt = list(range(40, 90))
    with grpc.insecure_channel(cluster["prefill"].info["grpc"]) as ch:
        first = pb_grpc.PrefillWorkerStub(ch).Prefill(
            pb.PrefillRequest(request_id="expired-1", prompt_token_ids=prompt, sampling=sampling()), timeout=60
        )
    port = cluster["ports"]["prefill"]
    deadline = time.monotonic() + 60
    while scrape(port, "cleave_kv_lease_expired_total") < 1:
        assert time.monotonic() < deadline, "the lease never expired"
        time.sleep(0.2)
    with grpc.insecure_channel(cluster["decode"].info["grpc"]) as ch:
        request = pb.GenerateRequest(request_id="expired-1", prompt_token_ids=prompt, sampling=sampling(),
                                     first_token=first.first_token, kv_handle=first.kv_handle)  # fmt: skip
        messages = list(pb_grpc.DecodeWorkerStub(ch).Generate(request, timeout=60))
    assert messages[0].kv_recomputed


@pytest.fixture(scope="module")
def workload(cluster):
    client = openai.OpenAI(base_url=cluster["base"] + "/v1", api_key="unused", max_retries=0, timeout=120)
    name = client.models.list().data[0].id
    for i, prompt in enumerate(PROMPTS):
        stream = client.completions.create(model=name, prompt=prompt, max_tokens=6, stream=bool(i % 2))
        if i % 2:
            assert list(stream)
    client.chat.completions.create(model=name, messages=[{"role": "user", "content": "hi"}], max_tokens=4)
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=name, prompt="x", max_tokens=-1)
    failed_kv_pull(cluster)
    return cluster


@pytest.mark.parametrize("process", ["router", "prefill", "decode"])
def test_promtool_finds_nothing_to_lint(workload, process):
    promtool = shutil.which("promtool")
    assert promtool, "promtool is not installed; `make test` installs it (Debian package prometheus)"
    with urllib.request.urlopen(f"http://127.0.0.1:{workload['ports'][process]}/metrics", timeout=10) as resp:
        body = resp.read()
    assert b"cleave_" in body
    result = subprocess.run([promtool, "check", "metrics"], input=body, capture_output=True, timeout=60)
    assert result.returncode == 0 and not result.stdout and not result.stderr, (result.stdout + result.stderr).decode()


def test_each_process_serves_only_its_own_metrics(workload):
    def names(port) -> set[str]:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as resp:
            return {line.split()[2] for line in resp.read().decode().splitlines() if line.startswith("# TYPE")}

    ports = workload["ports"]
    router, prefill, decode = names(ports["router"]), names(ports["prefill"]), names(ports["decode"])
    assert all(n.startswith("cleave_router_") for n in router)
    assert not any(n.startswith("cleave_router_") or n.startswith("python_") for n in prefill | decode)
    assert scrape(ports["decode"], "cleave_kv_transfer_bytes_total") > 0
    assert scrape(ports["prefill"], "cleave_kv_transfer_bytes_total") == 0  # pulls count where they land


def test_registry_entries_carry_each_workers_metrics_address(workload):
    async def entries():
        client = connect(workload["redis"].url)
        try:
            return await read_registry(client)
        finally:
            await client.aclose()

    by_role = {e.role: e for e in asyncio.run(entries())}
    assert set(by_role) == {"prefill", "decode"}
    for role, entry in by_role.items():
        assert entry.metrics_addr.endswith(f":{workload['ports'][role]}")
        with urllib.request.urlopen(f"http://{entry.metrics_addr}/metrics", timeout=10) as resp:
            assert f'role="{role}",worker_id="{entry.worker_id}"'.encode() in resp.read()


def dashboard_queries() -> list[tuple[str, str]]:
    dashboard = json.loads(DASHBOARD_PATH.read_text())
    queries = []
    for panel in dashboard["panels"]:
        for target in panel.get("targets", []):
            expr = target["expr"]
            for name, value in VARIABLES.items():
                expr = expr.replace(name, value)
            queries.append((f"{panel['title']} / {target['refId']}", expr))
    return queries


def test_every_dashboard_query_returns_data(workload):
    prom = workload["prometheus"]
    deadline = time.monotonic() + 90
    # Prometheus has the workload once it has scraped the recompute at least twice (rates need two samples).
    while not prom.query("increase(cleave_kv_recomputes_total[1m]) > 0"):
        seen = prom.query("cleave_kv_recomputes_total")
        assert time.monotonic() < deadline, f"Prometheus never saw the failed KV pull: {seen} {prom.targets()}"
        time.sleep(0.5)
    queries = dashboard_queries()
    assert len(queries) > 30
    empty = queries
    while empty:
        empty = [(title, expr) for title, expr in empty if not prom.query(expr)]
        if empty and time.monotonic() > deadline:
            pytest.fail("dashboard queries with no data:\n" + "\n".join(f"{t}: {e}" for t, e in empty))
        time.sleep(0.5)
    failures = prom.query(dict(queries)["KV pull failures/s / A"])
    assert max(float(sample["value"][1]) for sample in failures) > 0
    pools = {(s["metric"]["role"], s["metric"]["source"]): float(s["value"][1])
             for s in prom.query(dict(queries)["Pool workers / A"])}  # fmt: skip
    assert pools == {("prefill", "registry"): 1, ("prefill", "static"): 0, ("decode", "registry"): 1,
                     ("decode", "static"): 0}  # fmt: skip
    assert {s["metric"]["component"]: s["value"][1] for s in prom.query("cleave_router_redis_up")} == {
        "registry": "1", "kv_events": "1"}  # fmt: skip
    while not prom.query("cleave_router_kv_index_entries > 0"):  # the workload's blocks, from the event streams
        assert time.monotonic() < deadline, "the router's KV index stayed empty"
        time.sleep(0.5)


def wait_spans(receiver, done, timeout: float = 60):
    """Spans arrive in batches (every few seconds); poll until ``done(spans)`` holds."""
    deadline = time.monotonic() + timeout
    while True:
        spans = receiver.snapshot()
        if done(spans):
            return spans
        if time.monotonic() > deadline:
            pytest.fail("spans never arrived: " + ", ".join(sorted({f"{s.service}:{s.name}" for s in spans})))
        time.sleep(0.5)


def test_one_trace_spans_router_prefill_kv_transfer_and_decode(workload):
    def full_trace(spans):
        by_trace: dict[str, set[tuple[str, str]]] = {}
        for s in spans:
            by_trace.setdefault(s.trace_id, set()).add((s.service, s.name))
        want = {("cleave-router", "route"), ("cleave-prefill-worker", "prefill"),
                ("cleave-decode-worker", "kv_transfer"), ("cleave-decode-worker", "decode")}  # fmt: skip
        # The root ends last, so it can come in a later batch than its children: wait for it too.
        rooted = {s.trace_id for s in spans if s.service == "cleave-router" and s.name.startswith("text_completion ")}
        return [t for t, names in by_trace.items() if want <= names and t in rooted]

    spans = wait_spans(workload["receiver"], full_trace)
    trace_id = full_trace(spans)[0]
    trace = [s for s in spans if s.trace_id == trace_id]
    (root,) = [s for s in trace if s.service == "cleave-router" and s.name.startswith("text_completion ")]
    assert root.parent_span_id == ""
    assert root.attributes["gen_ai.operation.name"] == "text_completion"
    assert root.attributes["gen_ai.request.model"] == root.name.split(" ", 1)[1]
    assert root.attributes["gen_ai.usage.input_tokens"] > 0 and root.attributes["gen_ai.usage.output_tokens"] == 6
    assert root.attributes["gen_ai.response.finish_reasons"] == ["length"]
    assert root.attributes["gen_ai.server.time_to_first_token"] > 0
    by_name = {s.name: s for s in trace if s is not root}
    for name in ("route", "prefill", "decode"):
        assert by_name[name].parent_span_id == root.span_id, name
    kv = by_name["kv_transfer"]
    assert kv.parent_span_id == by_name["decode"].span_id
    assert kv.attributes["cleave.kv.bytes"] > 0 and kv.attributes["cleave.kv.blocks"] > 0
    assert kv.attributes["cleave.kv.backend"] == "tcp" and kv.status_code != 2
    assert kv.attributes["cleave.kv.local_read"] is True  # the workers share this machine
    assert by_name["prefill"].attributes["cleave.computed_tokens"] > 0
    assert by_name["decode"].attributes["gen_ai.usage.output_tokens"] == 5  # the first token came from prefill


def test_failed_kv_pull_marks_its_span_as_an_error(workload):
    def failed(spans):
        return [s for s in spans if s.name == "kv_transfer" and s.attributes.get("cleave.kv.recomputed")]

    (span,) = failed(wait_spans(workload["receiver"], failed))
    assert span.status_code == 2  # ERROR


def test_error_response_marks_the_request_span(workload):
    def errors(spans):
        return [s for s in spans if s.service == "cleave-router" and s.attributes.get("error.type") == "400"]

    assert errors(wait_spans(workload["receiver"], errors))


def json_lines(proc) -> list[dict]:
    return [json.loads(line) for line in proc.lines if line.startswith("{")]


def test_json_logs_one_access_line_per_request(workload):
    access = [e for e in json_lines(workload["router"]) if e.get("event") == "request"]
    assert len(access) == len(PROMPTS) + 2  # completions, the chat, the refused request
    ok = [e for e in access if e["status"] == "200"]
    assert len(ok) == len(PROMPTS) + 1
    for entry in ok:
        assert entry["method"] == "POST" and entry["request_id"].startswith(("cmpl-", "chatcmpl-"))
        assert entry["model"] and int(entry["prompt_tokens"]) > 0 and int(entry["completion_tokens"]) > 0
        assert float(entry["latency_ms"]) > 0
    assert [e["status"] for e in access if e not in ok] == ["400"]
    failed = [e for e in json_lines(workload["decode"]) if e.get("event") == "kv_pull_failed"]
    assert [e["request_id"] for e in failed] == ["expired-1"]
