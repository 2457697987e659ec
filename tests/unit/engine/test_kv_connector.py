"""The KV connector's scheduler side (exact block ids) and worker side, on CPU without torch."""

from __future__ import annotations

import pytest

from shared.engine.kv_cache_manager import KVCacheManager
from shared.engine.kv_connector import KVConnectorScheduler, KVConnectorWorker, LoadResult, RemoteKV
from shared.engine.kv_leases import KVLeases, ownership_problems
from shared.engine.request import Request, RequestStatus
from shared.engine.sampling_params import InvalidRequestError, SamplingParams
from shared.engine.scheduler import Scheduler, SchedulerConfig

BLOCK = 4
FIRST_TOKEN = 999


def setup(num_blocks: int = 16) -> tuple[KVCacheManager, Scheduler, KVConnectorScheduler]:
    kv = KVCacheManager(num_blocks=num_blocks, block_size=BLOCK)
    scheduler = Scheduler(SchedulerConfig(max_num_batched_tokens=64), kv)
    return kv, scheduler, KVConnectorScheduler(kv, scheduler, KVLeases(kv))


def owned(connector: KVConnectorScheduler) -> list[str]:
    """Problems of the block-ownership invariant (empty: every used block has its owner)."""
    return ownership_problems(connector.kv, set(connector.scheduler.requests), connector.leases)


def remote_request(rid: str, prompt: list[int]) -> Request:
    """A decode-side request: the prompt plus the first token the prefill worker sampled."""
    req = Request(rid, prompt, SamplingParams(max_tokens=8))
    req.append_output_token(FIRST_TOKEN)
    return req


def remote(block_ids: tuple[int, ...], num_tokens: int) -> RemoteKV:
    return RemoteKV("p-1", "peer", "127.0.0.1:1", block_ids, num_tokens)


def warm_cache(kv: KVCacheManager, tokens: list[int]) -> None:
    """Leave ``tokens``' full blocks in the prefix cache, as a finished local request would."""
    req = Request("warm", tokens, SamplingParams(max_tokens=1))
    assert kv.allocate_slots(req, len(tokens)) is not None
    req.num_computed_tokens = len(tokens)
    kv.cache_full_blocks(req)
    kv.free("warm")


def test_cold_cache_loads_every_remote_block_then_runs():
    kv, scheduler, connector = setup()
    req = remote_request("a", list(range(10)))
    load = connector.allocate(req, remote((7, 8, 9), 10))
    assert load is not None
    assert load.remote_block_ids == (7, 8, 9) and load.local_block_ids == (0, 1, 2)
    assert (load.num_local_tokens, load.num_remote_tokens) == (0, 10)
    assert req.request_id not in scheduler.requests  # not runnable before the load is done
    hold = connector.leases.get("a")
    assert hold is not None and hold.block_ids == (0, 1, 2) and owned(connector) == []  # a pull owns them
    connector.finish_load(req, load)
    assert "a" not in connector.leases and owned(connector) == []
    connector.free_unjoined(req)  # joined: the scheduler owns its blocks now, nothing is freed
    assert kv.block_ids("a") == [0, 1, 2]
    assert req.num_computed_tokens == 10 and req.num_cached_tokens == 0
    out = scheduler.schedule()
    [seq] = out.seqs
    assert (seq.token_ids, seq.start_pos, seq.block_ids) == ([FIRST_TOKEN], 10, [0, 1, 2])
    # The two full loaded blocks are now in the local prefix cache.
    assert [kv.pool.lookup(h).block_id for h in req.block_hashes(BLOCK)[:2]] == [0, 1]


def test_partial_local_hit_loads_only_the_missing_blocks():
    kv, _, connector = setup()
    shared_prefix = list(range(100, 108))  # two full blocks
    warm_cache(kv, shared_prefix + [1, 2, 3, 4])  # caches blocks 0, 1, 2; free queue ends 2, 1, 0
    req = remote_request("b", shared_prefix + [50, 51, 52, 53, 54, 55])  # 14 tokens: 4 blocks
    load = connector.allocate(req, remote((20, 21, 22, 23), 14))
    assert load is not None
    assert kv.block_ids("b") == [0, 1, 3, 4] and owned(connector) == []
    assert load.remote_block_ids == (22, 23) and load.local_block_ids == (3, 4)
    assert (load.num_local_tokens, load.num_remote_tokens) == (8, 6)
    connector.finish_load(req, load)
    assert req.num_computed_tokens == 14 and req.num_cached_tokens == 0  # the prefill worker reports its hits
    assert connector.num_local_hit_tokens == 8


def test_fully_cached_prompt_needs_no_load():
    kv, scheduler, connector = setup()
    prompt = list(range(200, 212))  # three full blocks
    warm_cache(kv, prompt + [1])
    req = remote_request("c", prompt)
    load = connector.allocate(req, remote((30, 31, 32), 12))
    assert load is not None and load.num_blocks == 0 and load.local_block_ids == ()
    assert kv.block_ids("c") == [0, 1, 2] and load.num_local_tokens == 12
    connector.finish_load(req, load)
    [seq] = scheduler.schedule().seqs
    # The first token opens a new block: 4, the head of the free queue (3 held the warm tail).
    assert (seq.start_pos, seq.block_ids) == (12, [0, 1, 2, 4])


def test_no_room_changes_nothing_and_unjoined_blocks_are_freed():
    kv, _, connector = setup(num_blocks=2)
    req = remote_request("d", list(range(10)))
    assert connector.allocate(req, remote((1, 2, 3), 10)) is None
    assert kv.num_free_blocks == 2 and kv.block_ids("d") == [] and req.num_computed_tokens == 0
    kv2, scheduler, connector2 = setup(num_blocks=4)
    req2 = remote_request("e", list(range(10)))
    assert connector2.allocate(req2, remote((1, 2, 3), 10)) is not None
    assert kv2.num_free_blocks == 1
    connector2.free_unjoined(req2)
    connector2.free_unjoined(req2)  # idempotent
    assert kv2.num_free_blocks == 4 and req2.status == RequestStatus.WAITING and owned(connector2) == []


def test_a_handle_that_cannot_describe_the_prompt_is_refused():
    _, _, connector = setup()
    req = remote_request("f", list(range(10)))
    with pytest.raises(InvalidRequestError, match="comes in 2 blocks.*need 3"):
        connector.allocate(req, remote((1, 2), 10))
    with pytest.raises(InvalidRequestError, match="covers 11 tokens"):
        connector.allocate(req, remote((1, 2, 3), 11))


class RecordingTransport:
    def __init__(self) -> None:
        self.pulls: list[tuple[str, list[int], list[int]]] = []
        self.released: list[RemoteKV] = []

    def pull(self, peer_id: str, remote_block_ids: list[int], local_block_ids: list[int]) -> LoadResult:
        self.pulls.append((peer_id, remote_block_ids, local_block_ids))
        return LoadResult(num_bytes=100 * len(remote_block_ids), seconds=0.0, num_descriptors=1)

    def release(self, remote_kv: RemoteKV) -> None:
        self.released.append(remote_kv)


def test_worker_side_pulls_only_what_the_load_names():
    kv, _, connector = setup()
    warm_cache(kv, list(range(100, 108)) + [1, 2, 3, 4])
    transport = RecordingTransport()
    worker = KVConnectorWorker(transport)
    try:
        partial = connector.allocate(remote_request("g", list(range(100, 108)) + [7, 7]), remote((5, 6, 9), 10))
        assert partial is not None
        assert worker.wait_for_load(worker.start_load(partial), timeout=10).num_bytes == 100
        assert transport.pulls == [("peer", [9], [3])]
        full = connector.allocate(remote_request("h", list(range(100, 108))), remote((5, 6), 8))
        assert full is not None
        assert worker.wait_for_load(worker.start_load(full)).num_bytes == 0
        assert len(transport.pulls) == 1  # nothing to move: the transport is not called
        worker.release_remote(full.remote)
        assert transport.released == [full.remote]
    finally:
        worker.close()
