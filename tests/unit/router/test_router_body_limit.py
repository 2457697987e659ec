"""Limits that keep one request from freezing or flooding the router: body size (413),
prompts far over the context (refused before tokenizing), choices per request, and
tokenization off the event loop (``/health`` keeps answering)."""

from __future__ import annotations

import threading
import time

import httpx

from tests.unit.router.test_router_errors import MODEL, assert_error

TEN_MB = 10 << 20


def test_a_body_over_the_cap_is_413_in_the_openai_shape(agg_router, script):
    resp = httpx.post(f"{agg_router.url}/v1/completions", content=b"x" * TEN_MB, timeout=60)
    assert_error(resp, 413, code="request_too_large", contains="--max-request-body-bytes")


def test_a_chunked_body_over_the_cap_is_413(router_factory, script):
    router = router_factory(prefill=False, max_request_body_bytes=1000)

    def chunks():
        for _ in range(10):
            yield b'{"prompt": "' + b"a" * 200

    resp = httpx.post(f"{router.url}/v1/completions", content=chunks(), timeout=30)
    assert_error(resp, 413, code="request_too_large")
    ok = httpx.post(f"{router.url}/v1/completions", json={"model": MODEL, "prompt": "Hi", "max_tokens": 2}, timeout=30)
    assert ok.status_code == 200, ok.text


def health_latencies(url: str, stop: threading.Event) -> list[float]:
    latencies: list[float] = []

    def poll() -> None:
        with httpx.Client(timeout=60) as client:
            while not stop.is_set():
                start = time.perf_counter()
                client.get(f"{url}/health")
                latencies.append(time.perf_counter() - start)
                time.sleep(0.02)

    thread = threading.Thread(target=poll, daemon=True)
    thread.start()
    stop.wait()
    thread.join(timeout=60)
    return latencies


def test_health_answers_while_huge_prompts_are_refused(router_factory, script):
    router = router_factory(prefill=False, max_request_body_bytes=64 << 20)
    stop = threading.Event()
    result: list[list[float]] = []
    poller = threading.Thread(target=lambda: result.append(health_latencies(router.url, stop)), daemon=True)
    poller.start()
    try:
        start = time.perf_counter()
        word_prompt = "word " * (TEN_MB // 5)  # 10 MB of text: refused before it is tokenized
        resp = httpx.post(f"{router.url}/v1/completions", json={"model": MODEL, "prompt": word_prompt}, timeout=60)
        refused_s = time.perf_counter() - start
        assert_error(resp, 400, code="context_length_exceeded", contains="characters")
        chat = httpx.post(
            f"{router.url}/v1/chat/completions",
            json={"model": MODEL, "messages": [{"role": "user", "content": word_prompt}]},
            timeout=60,
        )
        assert_error(chat, 400, code="context_length_exceeded")
        too_big = httpx.post(f"{router_factory(prefill=False).url}/v1/completions", content=b"x" * TEN_MB, timeout=60)
        assert too_big.status_code == 413
    finally:
        stop.set()
        poller.join(timeout=60)
    latencies = result[0]
    print(f"10 MB prompt refused in {refused_s:.2f} s; /health max {max(latencies) * 1000:.0f} ms "
          f"over {len(latencies)} polls")  # fmt: skip
    assert latencies and max(latencies) < 1.0


def test_choices_per_request_are_capped(router_factory, script):
    router = router_factory(prefill=False, max_choices_per_request=8)
    body = {"model": MODEL, "prompt": ["a", "b", "c"], "n": 3, "max_tokens": 2}
    assert_error(httpx.post(f"{router.url}/v1/completions", json=body, timeout=30), 400, param="n", contains="9")
    assert not script.generate_requests  # refused before any worker call
    body["n"] = 2
    assert httpx.post(f"{router.url}/v1/completions", json=body, timeout=30).status_code == 200
