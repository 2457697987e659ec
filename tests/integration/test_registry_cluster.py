"""Workers found through a real Redis registry: discovered in any order, a SIGKILLed one
dropped within its TTL, a Redis outage survived, a new worker used once it registers."""

from __future__ import annotations

import json
import signal
import time
import urllib.request

import openai
import pytest

from tests.integration.cluster import scrape, start_router, start_worker, wait_worker


def health(base: str) -> dict:
    try:
        with urllib.request.urlopen(base + "/health", timeout=5) as resp:
            return json.loads(resp.read())
    except urllib.error.HTTPError as e:
        return json.loads(e.read())


def wait_pools(base: str, num_prefill: int, decode_addrs: set[str], timeout: float = 60.0) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        body = health(base)
        prefill = [w for w in body["prefill"] if w["healthy"]]
        decode = {w["address"] for w in body["decode"] if w["healthy"]}
        if len(prefill) == num_prefill and decode == decode_addrs and len(body["decode"]) == len(decode_addrs):
            return body
        assert time.monotonic() < deadline, f"pools never became {num_prefill} prefill + {decode_addrs}: {body}"
        time.sleep(0.1)


def generated(proc) -> float:
    return scrape(proc.info["metrics_port"], "cleave_generation_tokens_total")


def wait_counter_above(proc, value: float, timeout: float = 15.0) -> None:
    """Worker counters are exported about once a second."""
    deadline = time.monotonic() + timeout
    while generated(proc) <= value:
        assert time.monotonic() < deadline, f"{proc.name} {proc.info['grpc']} served nothing"
        time.sleep(0.2)


@pytest.mark.slow
def test_registry_discovery_expiry_and_outage(model_dir, redis_server):
    redis = ["--redis-url", redis_server.url, "--kv-transfer-backend", "tcp"]
    procs = []
    try:
        first = wait_worker(start_worker("decode", model_dir, *redis))
        procs.append(first)
        router, base = start_router(model_dir, [], [], "--redis-url", redis_server.url)
        procs.append(router)
        later = [start_worker("prefill", model_dir, *redis), start_worker("prefill", model_dir, *redis),
                 start_worker("decode", model_dir, *redis)]  # fmt: skip
        procs += later
        for p in later:
            wait_worker(p)
        second = later[2]
        wait_pools(base, 2, {first.info["grpc"], second.info["grpc"]})
        client = openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=60)
        name = client.models.list().data[0].id

        def complete(prompt: str = "the river") -> str:
            out = client.completions.create(model=name, prompt=prompt, max_tokens=4, temperature=0,
                                            extra_body={"ignore_eos": True})  # fmt: skip
            assert out.usage.completion_tokens == 4
            return out.choices[0].text

        expected = complete()
        first.popen.send_signal(signal.SIGKILL)
        first.popen.wait()
        killed_at = time.monotonic()
        wait_pools(base, 2, {second.info["grpc"]}, timeout=30)
        # The registry's TTL is 4 s and the watcher reads every second.
        assert time.monotonic() - killed_at < 15
        for _ in range(3):
            assert complete() == expected

        redis_server.stop()
        for _ in range(3):
            assert complete() == expected  # routed on the last registry seen
        # The registry watcher reads once a second: keep Redis down until it has seen the outage.
        port = base.rsplit(":", 1)[1]
        deadline = time.monotonic() + 15
        while scrape(port, 'cleave_router_redis_up{component="registry"}') != 0:
            assert time.monotonic() < deadline, "the router's registry watcher never saw Redis down"
            time.sleep(0.1)
        assert complete() == expected
        redis_server.start()
        third = wait_worker(start_worker("decode", model_dir, *redis))
        procs.append(third)
        wait_pools(base, 2, {second.info["grpc"], third.info["grpc"]}, timeout=60)
        before = generated(third)
        for _ in range(4):
            assert complete() == expected
        wait_counter_above(third, before)
        log = "".join(router.lines)
        assert "worker_forgotten role=decode address=" + first.info["grpc"] in log
        assert "redis_unavailable" in log and "redis_reconnected" in log
        assert scrape(port, 'cleave_router_redis_reconnects_total{component="registry"}') >= 1
        assert scrape(port, 'cleave_router_redis_up{component="registry"}') == 1
        assert scrape(port, 'cleave_router_pool_workers{role="decode",source="registry"}') == 2
    finally:
        for p in procs:
            p.stop()
