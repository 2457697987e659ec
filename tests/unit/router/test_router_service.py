"""Router as a service: disconnects abort workers, trace context, health, models, metrics, settings, pools."""

from __future__ import annotations

import asyncio
import socket
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from services.router.metrics import RouterMetrics
from services.router.settings import parse_settings
from services.router.workers import NoWorkerAvailable, WorkerPool
from shared.genproto.cleave.v1 import worker_pb2

MODEL = "tiny-test"
REPO_ROOT = Path(__file__).resolve().parents[3]


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_stream_disconnect_aborts_the_worker(router, script, eventually, path):
    script.delay_s = 0.05
    body = {"model": MODEL, "max_tokens": 200, "stream": True}
    body.update({"prompt": "Hi"} if "chat" not in path else {"messages": [{"role": "user", "content": "Hi"}]})
    with httpx.Client(base_url=router.url, timeout=30) as client:
        with client.stream("POST", path, json=body) as response:
            assert response.status_code == 200
            lines = response.iter_lines()
            received = [line for _, line in zip(range(6), lines, strict=False) if line]
            assert received
    assert eventually(lambda: len(script.generate_requests) == 1)
    request_id = script.generate_requests[0].request_id
    assert eventually(lambda: request_id in script.aborted)
    assert eventually(lambda: request_id in script.cancelled)
    assert eventually(lambda: router.state.metrics.running._value.get() == 0)


def test_non_stream_disconnect_aborts_the_worker(agg_router, script, eventually):
    script.delay_s = 0.05
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{agg_router.url}/v1/completions", json={"prompt": "Hi", "max_tokens": 200}, timeout=0.5)
    assert eventually(lambda: len(script.generate_requests) == 1)
    request_id = script.generate_requests[0].request_id
    assert eventually(lambda: request_id in script.aborted)
    assert eventually(lambda: request_id in script.cancelled)


def test_worker_that_starts_late_is_picked_up(router_factory, script, start_decode_worker, eventually):
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    router = router_factory(prefill=False, decode=[f"127.0.0.1:{port}"])
    assert httpx.get(f"{router.url}/health").status_code == 503
    start_decode_worker(port)
    assert eventually(lambda: httpx.get(f"{router.url}/health").status_code == 200, timeout_s=10)
    response = httpx.post(f"{router.url}/v1/completions", json={"prompt": "Hi", "max_tokens": 2}, timeout=30)
    assert response.status_code == 200


def test_traceparent_is_continued(router, script):
    trace_id = "4bf92f3577b34da6a3ce929d0e0e4736"
    incoming = f"00-{trace_id}-00f067aa0ba902b7-01"
    httpx.post(
        f"{router.url}/v1/completions",
        json={"prompt": "Hi", "max_tokens": 3},
        headers={"traceparent": incoming},
        timeout=30,
    )
    assert len(script.metadata) == 2  # prefill, then decode
    for metadata in script.metadata:
        version, trace, span, flags = metadata["traceparent"].split("-")
        assert (version, trace, flags) == ("00", trace_id, "01") and span != "00f067aa0ba902b7"
        assert metadata["x-request-id"].startswith("cmpl-")


def test_traceparent_is_fresh_without_one(agg_router, script):
    # Tracing is off here: a fresh trace that nobody samples.
    httpx.post(f"{agg_router.url}/v1/completions", json={"prompt": "Hi", "max_tokens": 2}, timeout=30)
    version, trace, span, flags = script.metadata[0]["traceparent"].split("-")
    assert version == "00" and len(trace) == 32 and len(span) == 16 and not int(flags, 16) & 1


@pytest.mark.parametrize("incoming", ["garbage", "00-" + "0" * 32 + "-00f067aa0ba902b7-01"])
def test_malformed_traceparent_starts_a_fresh_trace(agg_router, script, incoming):
    httpx.post(f"{agg_router.url}/v1/completions", json={"prompt": "Hi", "max_tokens": 2},
               headers={"traceparent": incoming}, timeout=30)  # fmt: skip
    trace = script.metadata[-1]["traceparent"].split("-")[1]
    assert trace != "0" * 32 and len(trace) == 32


def test_health_models_metrics(router, script):
    health = httpx.get(f"{router.url}/health")
    assert health.status_code == 200 and health.json()["status"] == "ok"
    models = httpx.get(f"{router.url}/v1/models").json()
    assert models["object"] == "list"
    assert [(m["id"], m["object"], m["max_model_len"]) for m in models["data"]] == [(MODEL, "model", 256)]
    httpx.post(f"{router.url}/v1/completions", json={"prompt": "Hi", "max_tokens": 3}, timeout=30)
    httpx.post(f"{router.url}/v1/completions", json={"prompt": "Hi", "max_tokens": -3}, timeout=30)
    text = httpx.get(f"{router.url}/metrics").text
    for name in (
        'cleave_router_requests_total{endpoint="/v1/completions",status="200"}',
        'cleave_router_requests_total{endpoint="/v1/completions",status="400"}',
        "cleave_router_time_to_first_token_seconds_bucket",
        "cleave_router_time_per_output_token_seconds_bucket",
        "cleave_router_inter_token_latency_seconds_bucket",
        "cleave_router_e2e_request_latency_seconds_bucket",
        "cleave_router_prompt_tokens_total",
        "cleave_router_generation_tokens_total",
        "cleave_router_requests_running",
        'cleave_router_routed_sequences_total{path="disaggregated"}',
        'cleave_router_worker_healthy{address="127.0.0.1:',
    ):
        assert name in text, name


def test_request_log_line(agg_router, script, caplog):
    caplog.set_level("INFO", logger="cleave.router")
    httpx.post(f"{agg_router.url}/v1/completions", json={"prompt": "Hi", "max_tokens": 3}, timeout=30)
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("request ")]
    assert any("status=200" in line and "completion_tokens=3" in line and "request_id=cmpl-" in line for line in lines)


def test_router_imports_no_torch():
    code = (
        "import sys, services.router.app, services.router.__main__; assert 'torch' not in sys.modules, 'torch imported'"
    )
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr


def test_settings_from_env_and_flags():
    env = {
        "CLEAVE_MODEL": "/models/x",
        "CLEAVE_DECODE_WORKER": "a:1, b:2",
        "CLEAVE_PORT": "9000",
        "CLEAVE_LOG_LEVEL": "DEBUG",
    }
    settings = parse_settings([], env)
    assert (settings.model, settings.port, settings.log_level) == ("/models/x", 9000, "debug")
    assert settings.decode_workers == ("a:1", "b:2") and settings.prefill_workers == ()
    assert settings.model_name == "/models/x"
    settings = parse_settings(["--decode-worker", "c:3", "--served-model-name", "m", "--port", "0"], env)
    assert settings.decode_workers == ("c:3",) and settings.model_name == "m" and settings.port == 0
    with pytest.raises(SystemExit):
        parse_settings([], {})  # --model is required


def test_help_names_env_vars():
    result = subprocess.run(
        [sys.executable, "-m", "services.router", "--help"], cwd=REPO_ROOT, capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0
    assert "--prefill-worker" in result.stdout and "CLEAVE_DECODE_WORKER" in result.stdout


def _pool(policy: str, loads: list[int | None]) -> WorkerPool:
    pool = WorkerPool("decode", tuple(f"127.0.0.1:{i + 1}" for i in range(len(loads))), policy, RouterMetrics())
    for worker, load in zip(pool.workers, loads, strict=True):
        worker.healthy = load is not None
        worker.load = worker_pb2.LoadStatsResponse(num_waiting=load or 0)
    return pool


def test_pool_picks_least_loaded_then_rotates():
    async def scenario() -> None:
        pool = _pool("least_loaded", [3, 0, 0, None])
        picks = [(await pool.pick()).address for _ in range(4)]
        assert set(picks) == {"127.0.0.1:2", "127.0.0.1:3"}  # ties rotate, the busy and the dead are skipped
        pool.workers[1].num_in_flight = 5
        assert (await pool.pick()).address == "127.0.0.1:3"
        assert (await pool.pick(exclude={"127.0.0.1:3"})).address == "127.0.0.1:1"
        await pool.close()

    asyncio.run(scenario())


def test_pool_round_robin_and_none_healthy():
    async def scenario() -> None:
        pool = _pool("round_robin", [9, 0, None])
        assert [(await pool.pick()).address for _ in range(4)] == ["127.0.0.1:1", "127.0.0.1:2"] * 2
        for worker in pool.workers:
            worker.healthy = False
        with pytest.raises(NoWorkerAvailable, match="none healthy"):
            await pool.pick()  # polls once on demand; nothing listens on these ports
        await pool.close()

    asyncio.run(scenario())
