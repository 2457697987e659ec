"""Ownership of blocks outside the scheduler: leases of finished prefills, pulls in flight,
and the invariant check (used blocks = blocks of scheduled requests + leases + pulls)."""

from __future__ import annotations

import asyncio
import time

import pytest

from shared.config import EngineConfig
from shared.engine import SamplingParams
from shared.engine.async_engine import AsyncEngine
from shared.engine.engine_core import EngineCore
from shared.engine.kv_cache_manager import KVCacheManager
from shared.engine.kv_leases import LEASE, PULL, KVLeases, ownership_problems
from shared.engine.request import Request, RequestStatus


def request(request_id: str, num_tokens: int) -> Request:
    return Request(request_id, list(range(num_tokens)), SamplingParams(max_tokens=4))


def allocate(kv: KVCacheManager, req: Request) -> list[int]:
    ids = kv.allocate_slots(req, req.num_tokens)
    assert ids is not None
    return ids


def test_lease_release_frees_exactly_its_blocks():
    kv = KVCacheManager(num_blocks=8, block_size=4, enable_caching=False)
    leases = KVLeases(kv)
    ids = allocate(kv, request("a", 10))
    hold = leases.grant("a", LEASE, deadline=5.0)
    assert hold.block_ids == tuple(ids) == (0, 1, 2)
    assert (leases.num_leases, leases.num_held_blocks) == (1, 3)
    assert ownership_problems(kv, set(), leases) == []
    assert leases.release("a") and not leases.release("a")
    assert kv.num_free_blocks == 8 and (leases.num_leases, leases.num_held_blocks) == (0, 0)


def test_expiry_frees_only_past_deadlines_and_never_pulls():
    kv = KVCacheManager(num_blocks=8, block_size=4, enable_caching=False)
    leases = KVLeases(kv)
    for rid, kind, deadline in (("old", LEASE, 1.0), ("new", LEASE, 9.0), ("pull", PULL, None)):
        allocate(kv, request(rid, 4))
        leases.grant(rid, kind, deadline)
    assert leases.expire(now=5.0) == ["old"]
    assert leases.num_expired == 1 and kv.num_free_blocks == 6
    assert not leases.release("pull", kinds=(LEASE,))  # an abort leaves a pull alone
    leases.hand_over("pull")
    assert "pull" not in leases and kv.num_free_blocks == 6


def test_invariant_check_names_an_unowned_request():
    kv = KVCacheManager(num_blocks=8, block_size=4, enable_caching=False)
    allocate(kv, request("lost", 6))
    problems = ownership_problems(kv, set(), KVLeases(kv))
    assert problems == ["blocks [0, 1] of 'lost' have no owner"]
    assert ownership_problems(kv, {"lost"}, KVLeases(kv)) == []


@pytest.fixture(scope="module")
def core(checkpoint_factory) -> EngineCore:
    return EngineCore(
        EngineConfig(model=str(checkpoint_factory("llama")), dtype="float32", num_blocks=32, block_size=4)
    )


def finish_prefill(core: EngineCore, request_id: str) -> Request:
    req = core.make_request(request_id, list(range(3, 13)), SamplingParams(temperature=0.0, max_tokens=8))
    req.prefill_only = True
    req.kv_lease_seconds = 30.0
    core.scheduler.add_request(req)
    while core.has_unfinished():
        core.step()
    assert req.status == RequestStatus.FINISHED_PREFILLED
    return req


def test_the_step_that_finishes_a_prefill_grants_its_lease(core):
    finish_prefill(core, "p1")
    hold = core.leases.get("p1")
    assert hold is not None and hold.kind == LEASE and len(hold.block_ids) == 3
    assert core.ownership_problems() == []
    assert core.stats().num_leased_requests == 1
    # An abort after the prefill finished (client gone before the lease was used) frees the blocks.
    assert core.abort("p1")
    assert core.kv.num_free_blocks == core.num_blocks and core.ownership_problems() == []


def test_a_leased_request_id_cannot_be_reused(core):
    finish_prefill(core, "p2")
    with pytest.raises(Exception, match="already in use"):
        core.make_request("p2", [1, 2, 3], SamplingParams())
    core.leases.expire(now=float("inf"))
    assert core.kv.num_free_blocks == core.num_blocks


def test_engine_loop_expires_leases_and_checks_when_idle(checkpoint_factory):
    config = EngineConfig(model=str(checkpoint_factory("llama")), dtype="float32", num_blocks=32, block_size=4)
    engine = AsyncEngine(config)

    async def prefill() -> None:
        req = engine.core.make_request("e1", list(range(3, 13)), SamplingParams(temperature=0.0, max_tokens=8))
        req.prefill_only = True
        req.kv_lease_seconds = 0.2
        async for _ in engine.stream(req):
            pass

    try:
        asyncio.run(prefill())
        for _ in range(400):  # the deadline is 0.2 s away; poll generously
            if engine.core.leases.num_expired == 1:
                break
            time.sleep(0.05)
        assert engine.core.leases.num_expired == 1
        assert engine.call(lambda: engine.core.kv.num_free_blocks).result(timeout=10) == engine.core.num_blocks
        # A block that no one owns is reported by the idle-time check.
        engine.call(lambda: engine.core.kv.allocate_slots(Request("ghost", [1, 2], SamplingParams()), 2)).result(10)
        for _ in range(400):
            if engine.ownership_error:
                break
            time.sleep(0.05)
        assert "'ghost' have no owner" in engine.ownership_error
    finally:
        engine.shutdown()
