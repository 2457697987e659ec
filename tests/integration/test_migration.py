"""Streams that survive: a decode worker SIGKILLed under 20 streams. With migration every stream
finishes with the text of an uninterrupted run; with ``--migration-limit 0`` each stream on the
dead worker ends with an error event within a second. No blocks stay held on the survivors."""

from __future__ import annotations

import signal
import threading
import time

import openai
import pytest

from tests.integration.cluster import scrape, start_router, start_worker, wait_worker
from tests.integration.test_cluster import load_stats, wait_all_free

NUM_STREAMS = 20
MAX_TOKENS = 300
PROMPTS = [f"the weather on day {i} was" for i in range(NUM_STREAMS)]


@pytest.fixture(scope="module")
def fleet(checkpoint_factory):
    model_dir = checkpoint_factory("llama", max_position_embeddings=4096)
    tcp = ("--kv-transfer-backend", "tcp")
    procs = [start_worker("prefill", model_dir, *tcp)] + [start_worker("decode", model_dir, *tcp) for _ in range(3)]
    routers = []
    try:
        for p in procs:
            wait_worker(p)
        yield model_dir, procs, routers
    finally:
        for p in routers + procs:
            p.stop()


class Streams:
    """``NUM_STREAMS`` greedy streams in threads: their texts, errors and when each ended."""

    def __init__(self, base: str) -> None:
        self.client = openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=120)
        self.name = self.client.models.list().data[0].id
        self.texts = [""] * NUM_STREAMS
        self.errors: list[BaseException | None] = [None] * NUM_STREAMS
        self.ended_at = [0.0] * NUM_STREAMS
        self.num_chunks = [0] * NUM_STREAMS
        self.threads = [threading.Thread(target=self._run, args=(i,), daemon=True) for i in range(NUM_STREAMS)]

    def _run(self, i: int) -> None:
        try:
            stream = self.client.completions.create(model=self.name, prompt=PROMPTS[i], max_tokens=MAX_TOKENS,
                                                    temperature=0, stream=True, extra_body={"ignore_eos": True})  # fmt: skip
            for chunk in stream:
                self.num_chunks[i] += 1
                if chunk.choices:
                    self.texts[i] += chunk.choices[0].text
        except BaseException as e:  # noqa: BLE001 (recorded for the test to assert on)
            self.errors[i] = e
        self.ended_at[i] = time.monotonic()

    def start(self) -> Streams:
        for t in self.threads:
            t.start()
        return self

    def wait_all_started(self, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while min(self.num_chunks) < 3:
            assert time.monotonic() < deadline, f"streams did not start: {self.num_chunks}"
            time.sleep(0.01)

    def join(self) -> None:
        for t in self.threads:
            t.join(timeout=180)
            assert not t.is_alive(), "a stream hung"


def kill_busiest(decodes) -> object:
    victim = max(decodes, key=lambda d: load_stats(d).num_running)
    assert load_stats(victim).num_running > 0
    victim.popen.send_signal(signal.SIGKILL)
    return victim


@pytest.mark.slow
def test_streams_migrate_and_match_an_uninterrupted_run(fleet):
    model_dir, procs, routers = fleet
    router, base = start_router(model_dir, procs[:1], procs[1:])
    routers.append(router)
    reference = Streams(base).start()
    reference.join()
    assert reference.errors == [None] * NUM_STREAMS
    streams = Streams(base).start()
    streams.wait_all_started()
    victim = kill_busiest(procs[1:])
    streams.join()
    assert streams.errors == [None] * NUM_STREAMS
    assert streams.texts == reference.texts
    num_moved = "".join(router.lines).count("stream_migrated")
    assert num_moved > 0
    assert scrape(base.rsplit(":", 1)[1], 'cleave_router_migrations_total{outcome="migrated"}') == num_moved
    survivors = [d for d in procs[1:] if d is not victim]
    wait_all_free(procs[0], *survivors)
    procs.remove(victim)


@pytest.mark.slow
def test_without_migration_each_broken_stream_ends_with_an_error_within_a_second(fleet):
    model_dir, procs, routers = fleet
    decodes = procs[1:]
    assert len(decodes) == 2, "runs after the migration test, on the decode workers it left"
    router, base = start_router(model_dir, procs[:1], decodes, "--migration-limit", "0")
    routers.append(router)
    streams = Streams(base).start()
    streams.wait_all_started()
    victim = kill_busiest(decodes)
    killed_at = time.monotonic()
    streams.join()
    broken = [i for i, e in enumerate(streams.errors) if e is not None]
    assert broken, "no stream was on the killed worker"
    for i in broken:
        assert isinstance(streams.errors[i], openai.APIError)
        assert streams.ended_at[i] - killed_at < 1.0, f"stream {i} ended {streams.ended_at[i] - killed_at:.2f}s late"
    assert scrape(base.rsplit(":", 1)[1], 'cleave_router_migrations_total{outcome="refused"}') == len(broken)
    survivor = next(d for d in decodes if d is not victim)
    wait_all_free(procs[0], survivor)
