"""Draining with real processes: SIGTERM a decode worker while 20 streams run through the router.

Every stream completes with all its tokens, the worker reports unhealthy at once
(HTTP ``/health`` on its metrics port answers 503), new requests go to the other
decode worker, and the drained worker exits 0. Then the deployment smoke check
(``python -m shared.tools.smoke``, the chart's ``helm test``) passes.
"""

from __future__ import annotations

import asyncio
import json
import re
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from typing import Any

import openai
import pytest

from tests.integration.cluster import ROOT, start_router, start_worker, wait_worker
from tests.integration.test_cluster import load_stats

# Enough streamed tokens that the victim's drain outlasts the health polls below: the CPU forward of
# the tiny test model takes well under a millisecond a step, so the streams' own delivery sets the pace.
NUM_STREAMS = 40
MAX_TOKENS = 220


def _health_status(metrics_port: str) -> int:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/health", timeout=2) as resp:
            return resp.status
    except urllib.error.HTTPError as e:
        return e.code


def _reports_unhealthy_within(metrics_port: str, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while _health_status(metrics_port) != 503:
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def _router_sees_healthy(base: str, address: str) -> bool:
    try:
        with urllib.request.urlopen(base + "/health", timeout=2) as resp:
            body = json.loads(resp.read())
    except urllib.error.HTTPError as e:
        body = json.loads(e.read())
    (worker,) = [w for w in body["decode"] if w["address"] == address]
    return worker["healthy"]


async def _stream(client: openai.AsyncOpenAI, model: str) -> tuple[int, str]:
    stream = await client.completions.create(
        model=model, prompt="Hello there", max_tokens=MAX_TOKENS, temperature=0.0, stream=True,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    num_chunks, finish = 0, ""
    async for chunk in stream:
        num_chunks += 1
        finish = chunk.choices[0].finish_reason or finish
    return num_chunks, finish


@pytest.mark.slow
def test_sigterm_during_streams_drains_and_exits_zero(model_dir) -> None:
    workers = [wait_worker(start_worker("decode", model_dir, "--drain-timeout", "60")) for _ in range(2)]
    router, base = start_router(model_dir, [], workers, "--health-interval", "0.5")
    try:
        victim = asyncio.run(_drive(base, str(model_dir), workers))
        (survivor,) = [w for w in workers if w is not victim]
        assert victim.popen.wait(timeout=90) == 0, "".join(victim.lines[-30:])
        drained = [line for line in victim.lines if "drain_started" in line]
        assert drained and int(re.search(r"in_flight=(\d+)", drained[0]).group(1)) > 0, "SIGTERM came too late"
        assert any("drain_finished clean=True" in line for line in victim.lines)
        assert survivor.popen.poll() is None
        # The deployment smoke check (the chart's `helm test` pod) passes against what is left.
        smoke = subprocess.run([sys.executable, "-m", "shared.tools.smoke", "--url", base, "--wait", "30"],
                               capture_output=True, text=True, timeout=60, cwd=ROOT)  # fmt: skip
        assert smoke.returncode == 0 and smoke.stdout.startswith("smoke ok"), smoke.stdout + smoke.stderr
    finally:
        for proc in (router, *workers):
            proc.stop()


async def _drive(base: str, model: str, workers: list) -> Any:
    """Streams through the router; SIGTERMs the first worker seen running some of them (the victim, returned)."""
    client = openai.AsyncOpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=300)
    tasks = [asyncio.create_task(_stream(client, model)) for _ in range(NUM_STREAMS)]

    def sigterm_once_streaming() -> tuple[Any, int, bool]:
        # From a thread: this event loop is busy reading the streams' chunks, and a signal or a poll that
        # waits its turn here can come after the victim has finished them all. The workers' own gauges
        # say where streams run (the client's first chunks can trail an engine by its whole run, and the
        # router may well send all 40 to one worker). Their live LoadStats, not the /metrics gauge: that one
        # is refreshed once a second, and a worker can run its share of the streams between two refreshes.
        deadline = time.monotonic() + 120
        while True:
            running = [w for w in workers if load_stats(w).num_running >= 1]
            if running:
                break
            assert not all(t.done() for t in tasks), f"the streams ended before any was seen: {tasks[0]}"
            assert time.monotonic() < deadline, "the streams did not start"
            time.sleep(0.002)
        victim = running[0]
        before = _health_status(victim.info["metrics_port"])
        victim.popen.send_signal(signal.SIGTERM)
        return victim, before, _reports_unhealthy_within(victim.info["metrics_port"], 10)

    victim, before, unhealthy = await asyncio.to_thread(sigterm_once_streaming)
    assert before == 200
    assert unhealthy, "drained worker still reports healthy"  # at once, while its streams still run
    # The router marks it unhealthy within a health poll (0.5 s here), while its streams still run.
    deadline = time.monotonic() + 10
    while _router_sees_healthy(base, victim.info["grpc"]):
        assert time.monotonic() < deadline, "router still sends to the draining worker"
        await asyncio.sleep(0.1)
    # New work goes to the other worker: these complete although the victim admits nothing.
    fresh = await asyncio.gather(
        *[client.completions.create(model=model, prompt="Hi", max_tokens=4, temperature=0.0) for _ in range(3)]
    )
    assert all(c.choices[0].finish_reason for c in fresh)
    results = await asyncio.gather(*tasks)
    # One chunk per token (the last chunk may carry only the finish reason).
    for num_chunks, finish in results:
        assert finish == "length" and num_chunks >= MAX_TOKENS
    await client.close()
    return victim
