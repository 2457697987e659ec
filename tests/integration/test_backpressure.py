"""``--max-queued-requests`` against a real decode worker: it counts the worker's own queue (as the
worker reports it), so a router refuses work that another router queued there; and the calls a
router sent since its last load poll, so a burst between polls is refused too. 429 with Retry-After
in the OpenAI error shape."""

from __future__ import annotations

import threading
import time

import httpx
import pytest

from tests.integration.cluster import scrape, start_router, start_worker, wait_worker
from tests.integration.test_cluster import load_stats, wait_all_free

LONG = {"prompt": "the weather on a long day", "max_tokens": 300, "ignore_eos": True, "temperature": 0}
SHORT = {"prompt": "hello", "max_tokens": 2}


@pytest.fixture(scope="module")
def decode(checkpoint_factory):
    """One decode worker that runs one request at a time: the others wait in its queue."""
    model_dir = checkpoint_factory("llama", max_position_embeddings=4096)
    proc = start_worker("decode", model_dir, "--max-num-seqs", "1")
    try:
        yield model_dir, wait_worker(proc)
    finally:
        proc.stop()


def post(base: str, body: dict, timeout: float = 120) -> httpx.Response:
    return httpx.post(f"{base}/v1/completions", json=body, timeout=timeout)


class Background:
    """``count`` requests in threads; ``join`` returns their statuses."""

    def __init__(self, base: str, body: dict, count: int) -> None:
        self.statuses: list[int] = []
        self.threads = [threading.Thread(target=self._post, args=(base, body), daemon=True) for _ in range(count)]
        for t in self.threads:
            t.start()

    def _post(self, base: str, body: dict) -> None:
        self.statuses.append(post(base, body).status_code)

    def join(self) -> list[int]:
        for t in self.threads:
            t.join(timeout=180)
            assert not t.is_alive(), "a request hung"
        return self.statuses


def wait_until(predicate, what: str, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting until {what}"
        time.sleep(0.05)


def assert_429(response: httpx.Response) -> None:
    assert response.status_code == 429, response.text
    assert response.headers["retry-after"] == "1"
    error = response.json()["error"]
    assert error["type"] == "rate_limit_error" and error["code"] == "rate_limit_exceeded"
    assert "--max-queued-requests" in error["message"]


def queued(base: str) -> float:
    return scrape(base.rsplit(":", 1)[1], "cleave_router_worker_queued")  # one decode worker, no prefill pool


def test_a_router_refuses_what_another_router_queued_on_the_worker(decode):
    model_dir, worker = decode
    filler, filler_base = start_router(model_dir, [], [worker])  # no limit: it queues on the worker
    guard, guard_base = start_router(model_dir, [], [worker], "--max-queued-requests", "1", "--health-interval",
                                     "0.2")  # fmt: skip
    try:
        assert post(guard_base, SHORT).status_code == 200  # an idle worker: accepted
        filling = Background(filler_base, LONG, 5)
        wait_until(lambda: load_stats(worker).num_waiting >= 1, "the worker queues requests")
        wait_until(lambda: queued(guard_base) >= 1, "the guarded router's poll sees the worker's queue")
        assert_429(post(guard_base, SHORT))
        assert scrape(guard_base.rsplit(":", 1)[1], 'cleave_router_rejected_requests_total{role="decode"}') >= 1
        assert filling.join() == [200] * 5
        wait_until(lambda: queued(guard_base) == 0, "the queue drains")
        assert post(guard_base, SHORT).status_code == 200
        wait_all_free(worker)
    finally:
        filler.stop()
        guard.stop()


def test_a_burst_between_polls_is_counted(decode):
    model_dir, worker = decode
    # Polls at start only (every 60 s after): the calls it sends since are all it can count.
    router, base = start_router(model_dir, [], [worker], "--max-queued-requests", "1", "--health-interval", "60")
    try:
        assert load_stats(worker).num_waiting == 0
        first = Background(base, LONG, 1)
        wait_until(lambda: load_stats(worker).num_running == 1, "the first request runs")
        assert_429(post(base, SHORT))
        assert first.join() == [200]
        assert post(base, SHORT).status_code == 200  # its call ended: nothing of it is queued any more
        wait_all_free(worker)
    finally:
        router.stop()
