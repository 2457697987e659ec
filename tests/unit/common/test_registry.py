"""Registry entries in a real redis-server: heartbeat, TTL expiry, graceful delete, outage;
the router's watcher growing and shrinking its pools from them."""

from __future__ import annotations

import asyncio
import logging
import time

import pytest

from services.common import registry
from services.common.registry import WorkerEntry, WorkerRegistrar, connect, read_registry
from services.router.discovery import RegistryWatcher
from services.router.metrics import RouterMetrics
from services.router.workers import WorkerPools


def entry(worker_id: str, role: str = "decode", compat: str = "abc", port: int = 1) -> WorkerEntry:
    return WorkerEntry(worker_id=worker_id, role=role, grpc_addr=f"127.0.0.1:{port}", metrics_addr="",
                       model="m", compat_hash=compat, block_size=16, hash_seed="", num_blocks=64)  # fmt: skip


def test_entry_round_trips_through_strings():
    e = WorkerEntry(**{**entry("w1").__dict__, "num_running": 3, "kv_cache_usage": 0.25})
    assert WorkerEntry.from_mapping(e.to_mapping()) == e
    with pytest.raises(KeyError):
        WorkerEntry.from_mapping({"worker_id": "w1"})


async def _poll_until(condition, timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    while not await condition():
        assert time.monotonic() < deadline, "condition not reached in time"
        await asyncio.sleep(0.05)


def test_heartbeat_expiry_and_deregister(redis_server, monkeypatch):
    monkeypatch.setattr(registry, "TTL_S", 1)

    async def main() -> None:
        client = connect(redis_server.url)
        alive = WorkerRegistrar(redis_server.url, lambda: entry("alive"))
        killed = WorkerRegistrar(redis_server.url, lambda: entry("killed", port=2))
        task = asyncio.create_task(alive.run())
        await killed.heartbeat()  # then never again, as if SIGKILLed

        async def both() -> bool:
            return {e.worker_id for e in await read_registry(client)} == {"alive", "killed"}

        async def only_alive() -> bool:
            return {e.worker_id for e in await read_registry(client)} == {"alive"}

        await _poll_until(both)
        await _poll_until(only_alive)  # the silent one's TTL ran out; the heartbeat kept the other
        task.cancel()
        await alive.deregister()
        assert await read_registry(client) == []
        await killed.client.aclose()
        await client.aclose()

    asyncio.run(main())


def test_calls_fail_fast_when_redis_is_down(redis_server):
    async def main() -> None:
        registrar = WorkerRegistrar(redis_server.url, lambda: entry("w"))
        await registrar.heartbeat()
        redis_server.stop()
        start = time.monotonic()
        with pytest.raises(registry.REDIS_ERRORS):
            await registrar.heartbeat()
        await registrar.deregister()  # logs, does not raise
        assert time.monotonic() - start < 10

    asyncio.run(main())


def test_watcher_adds_forgets_and_refuses_mismatched_hash(redis_server, caplog):
    async def main() -> None:
        pools = WorkerPools((), ("127.0.0.1:9",), "least_loaded", RouterMetrics())
        watcher = RegistryWatcher(redis_server.url, pools)
        await watcher.apply([entry("d1", port=11), entry("p1", role="prefill", port=12)])
        assert [w.address for w in pools.decode.workers] == ["127.0.0.1:9", "127.0.0.1:11"]
        assert [w.address for w in pools.prefill.workers] == ["127.0.0.1:12"]
        with caplog.at_level(logging.WARNING, "cleave.router.discovery"):
            await watcher.apply([entry("d1", port=11), entry("d2", port=13, compat="other")])
        assert "worker_refused worker_id=d2" in caplog.text and "compat_hash_mismatch" in caplog.text
        assert [w.address for w in pools.decode.workers] == ["127.0.0.1:9", "127.0.0.1:11"]
        assert pools.prefill.workers == []  # its entry is gone
        await watcher.apply([])
        assert [w.address for w in pools.decode.workers] == ["127.0.0.1:9"]  # static workers stay
        await watcher.close()
        await pools.close()

    asyncio.run(main())


def test_watcher_keeps_last_registry_through_an_outage(redis_server):
    async def main() -> None:
        pools = WorkerPools((), (), "least_loaded", RouterMetrics())
        watcher = RegistryWatcher(redis_server.url, pools, interval_s=0.05)
        registrar = WorkerRegistrar(redis_server.url, lambda: entry("d1", port=11))
        await registrar.heartbeat()
        task = asyncio.create_task(watcher.run())

        async def found() -> bool:
            return len(pools.decode.workers) == 1

        await _poll_until(found)
        redis_server.stop()
        reads = watcher.num_reads
        await asyncio.sleep(0.5)
        assert watcher.num_reads == reads and len(pools.decode.workers) == 1
        redis_server.start()

        async def registered() -> bool:  # the first call after the restart may meet a stale connection
            try:
                await registrar.heartbeat()
                return True
            except registry.REDIS_ERRORS:
                return False

        await _poll_until(registered)

        async def reading_again() -> bool:
            return watcher.num_reads > reads

        await _poll_until(reading_again)
        assert len(pools.decode.workers) == 1
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await registrar.deregister()
        await watcher.close()
        await pools.close()

    asyncio.run(main())
