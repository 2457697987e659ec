"""Streams that survive: a decode worker SIGKILLed while 20 streams (greedy and seeded) start, the first
of them running on it, the rest sent after. With migration every stream finishes with the text of an
uninterrupted run, and so does every choice of forked ``n = 3`` streams; with ``--migration-limit 0``
each stream on the dead worker ends with an error event within a second. No blocks stay held on the
survivors."""

from __future__ import annotations

import signal
import threading
import time

import openai
import pytest

from tests.integration.cluster import scrape, start_router, start_worker, wait_worker
from tests.integration.test_cluster import load_stats, wait_all_free

NUM_STREAMS = 20
MAX_TOKENS = 1000
PROMPTS = [f"the weather on day {i} was" for i in range(NUM_STREAMS)]
NUM_FORKS = 6
# Forks start one after the other, and the victim must still run both of its own (a greedy and a
# seeded one) when it is killed: longer than the single streams, so the first fork's tokens outlast
# the last fork's start on a fast machine.
FORK_MAX_TOKENS = 1200


def sampling(i: int, n: int) -> dict:
    """Greedy and seeded streams, mixed so that round-robin puts both kinds on every worker (the streams
    start in order): single streams alternate by rounds of 4 (the decode workers), forks one by one."""
    seeded = (i // 4) % 2 if n == 1 else i % 2
    return {"temperature": 0.9, "seed": 1000 + i} if seeded else {"temperature": 0}


@pytest.fixture(scope="module")
def fleet(checkpoint_factory):
    model_dir = checkpoint_factory("llama", max_position_embeddings=4096)
    tcp = ("--kv-transfer-backend", "tcp")
    procs = [start_worker("prefill", model_dir, *tcp)] + [start_worker("decode", model_dir, *tcp) for _ in range(4)]
    routers = []
    try:
        for p in procs:
            wait_worker(p)
        yield model_dir, procs, routers
    finally:
        for p in routers + procs:
            p.stop()


class Streams:
    """Streams in threads (``n`` choices each): their texts per choice, errors, request ids and when each ended."""

    def __init__(self, base: str, num_streams: int = NUM_STREAMS, n: int = 1, max_tokens: int = MAX_TOKENS) -> None:
        self.client = openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=120)
        self.name = self.client.models.list().data[0].id
        self.n = n
        self.max_tokens = max_tokens
        self.texts = [[""] * n for _ in range(num_streams)]
        self.errors: list[BaseException | None] = [None] * num_streams
        self.request_ids = [""] * num_streams
        self.ended_at = [0.0] * num_streams
        self.num_chunks = [0] * num_streams
        self.threads = [threading.Thread(target=self._run, args=(i,), daemon=True) for i in range(num_streams)]
        self.num_started = 0

    def _run(self, i: int) -> None:
        try:
            stream = self.client.completions.create(model=self.name, prompt=PROMPTS[i], max_tokens=self.max_tokens, n=self.n,
                                                    stream=True, extra_body={"ignore_eos": True}, **sampling(i, self.n))  # fmt: skip
            self.request_ids[i] = stream.response.headers["x-request-id"]
            for chunk in stream:
                self.num_chunks[i] += 1
                for choice in chunk.choices:
                    self.texts[i][choice.index] += choice.text
        except BaseException as e:  # noqa: BLE001 (recorded for the test to assert on)
            self.errors[i] = e
        self.ended_at[i] = time.monotonic()

    def start(self, count: int | None = None, timeout: float = 60.0) -> Streams:
        """Start the next ``count`` streams (the rest by default) one after the other, each answered before
        the next, so they reach the router in order."""
        deadline = time.monotonic() + timeout
        end = len(self.threads) if count is None else self.num_started + count
        for i in range(self.num_started, end):
            self.threads[i].start()
            while not self.request_ids[i] and self.errors[i] is None:
                assert time.monotonic() < deadline, f"stream {i} got no answer"
                time.sleep(0.005)
        self.num_started = end
        return self

    def seeded(self, indices: list[int]) -> list[int]:
        return [i for i in indices if "seed" in sampling(i, self.n)]

    def join(self) -> None:
        for t in self.threads:
            t.join(timeout=180)
            assert not t.is_alive(), "a stream hung"

    def moved(self, router) -> list[int]:
        """The streams the router migrated (its log names their worker requests)."""
        log = "".join(router.lines)
        return [i for i, rid in enumerate(self.request_ids) if f"stream_migrated request_id={rid}-" in log]


def kill_busiest(decodes) -> object:
    victim = max(decodes, key=lambda d: load_stats(d).num_running)
    assert load_stats(victim).num_running > 0
    victim.popen.send_signal(signal.SIGKILL)
    return victim


@pytest.mark.slow
def test_streams_migrate_and_match_an_uninterrupted_run(fleet):
    model_dir, procs, routers = fleet
    router, base = start_router(model_dir, procs[:1], procs[1:], "--routing-policy", "round_robin")
    routers.append(router)
    reference = Streams(base).start()
    reference.join()
    assert reference.errors == [None] * NUM_STREAMS
    # The victim dies once the first round of greedy streams and the first seeded one run (round-robin: two
    # on the first worker), not after every start: the engines run ahead of this client's threads, and on
    # a loaded machine the 20 starts took longer than a stream takes to finish on its worker.
    streams = Streams(base).start(5)
    victim = kill_busiest(procs[1:])
    procs.remove(victim)  # the next tests run on the workers left, whatever this one finds
    streams.start()
    streams.join()
    assert streams.errors == [None] * NUM_STREAMS
    assert streams.texts == reference.texts
    moved = streams.moved(router)
    assert streams.seeded(moved) and len(streams.seeded(moved)) < len(moved), f"greedy and seeded moved: {moved}"
    num_moved = "".join(router.lines).count("stream_migrated")
    assert num_moved > 0
    assert scrape(base.rsplit(":", 1)[1], 'cleave_router_migrations_total{outcome="migrated"}') == num_moved
    wait_all_free(*procs)  # the prefill worker and the survivors


@pytest.mark.slow
def test_forked_streams_migrate_sample_by_sample_and_match_an_uninterrupted_run(fleet):
    model_dir, procs, routers = fleet
    decodes = procs[1:]
    assert len(decodes) == 3, "runs after the first migration test, on the decode workers it left"
    router, base = start_router(model_dir, procs[:1], decodes, "--routing-policy", "round_robin")
    routers.append(router)
    reference = Streams(base, NUM_FORKS, n=3, max_tokens=FORK_MAX_TOKENS).start()
    reference.join()
    assert reference.errors == [None] * NUM_FORKS
    seeded = reference.seeded(list(range(NUM_FORKS)))
    assert all(len(set(reference.texts[i])) == 3 for i in seeded), "a seeded fork's choices differ"
    streams = Streams(base, NUM_FORKS, n=3, max_tokens=FORK_MAX_TOKENS).start(
        4
    )  # a greedy and a seeded fork on the first worker
    victim = kill_busiest(decodes)
    procs.remove(victim)
    streams.start()
    streams.join()
    assert streams.errors == [None] * NUM_FORKS
    assert streams.texts == reference.texts
    moved = streams.moved(router)
    assert streams.seeded(moved) and len(streams.seeded(moved)) < len(moved), f"greedy and seeded moved: {moved}"
    num_moved = "".join(router.lines).count("stream_migrated")  # a fork moves once, all its samples at a time
    assert scrape(base.rsplit(":", 1)[1], 'cleave_router_migrations_total{outcome="migrated"}') == num_moved
    wait_all_free(*procs)


@pytest.mark.slow
def test_without_migration_each_broken_stream_ends_with_an_error_within_a_second(fleet):
    model_dir, procs, routers = fleet
    decodes = procs[1:]
    assert len(decodes) == 2, "runs after the migration test, on the decode workers it left"
    router, base = start_router(model_dir, procs[:1], decodes, "--migration-limit", "0")
    routers.append(router)
    streams = Streams(base).start(4)  # early, as above: a stream's error comes after the chunks before it
    victim = kill_busiest(decodes)
    killed_at = time.monotonic()
    streams.start()
    streams.join()
    broken = [i for i, e in enumerate(streams.errors) if e is not None]
    assert broken, "no stream was on the killed worker"
    for i in broken:
        assert isinstance(streams.errors[i], openai.APIError)
        assert streams.ended_at[i] - killed_at < 1.0, f"stream {i} ended {streams.ended_at[i] - killed_at:.2f}s late"
    assert scrape(base.rsplit(":", 1)[1], 'cleave_router_migrations_total{outcome="refused"}') == len(broken)
    survivor = next(d for d in decodes if d is not victim)
    wait_all_free(procs[0], survivor)
