"""kv_aware costs: work in flight counts only the blocks a call makes its worker compute or pull."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from services.router.kv_index import KVIndex
from services.router.kv_routing import KVRouter, PromptBlocks
from services.router.workers import DECODE, WorkerClient
from shared.engine.prefix_hash import block_hashes

BLOCK = 16


@dataclass
class _Entry:
    worker_id: str


def _workers() -> list[WorkerClient]:
    workers = [WorkerClient(f"127.0.0.1:{port}", DECODE) for port in (1, 2)]  # never dialled
    for worker, worker_id in zip(workers, ("a", "b"), strict=True):
        worker.entry = _Entry(worker_id)
    return workers


def test_requests_running_on_a_prefix_holder_keep_its_group_there():
    async def scenario() -> None:
        prefix = list(range(64 * BLOCK))  # 64 blocks, as a 1,024-token shared system prompt
        index = KVIndex()
        index.store("a", block_hashes(prefix, BLOCK))
        router = KVRouter(index, watcher=None)  # type: ignore[arg-type]
        holder, other = _workers()

        def prompt(user: int) -> PromptBlocks:
            suffix = [10_000 + 100 * user + i for i in range(4 * BLOCK)]
            return PromptBlocks(block_hashes(prefix + suffix, BLOCK), BLOCK)

        first, second, third = prompt(1), prompt(2), prompt(3)
        assert router.uncached_blocks(holder, first) == 4 and router.uncached_blocks(other, first) == 68
        assert router.chooser(first)([other, holder]) is holder
        # Two users of the group run on the holder: each costs it its 4 uncached blocks, not all 68.
        with holder.track(router.uncached_blocks(holder, first)):
            assert holder.in_flight_blocks == 4
            assert router.chooser(second)([other, holder]) is holder
            with holder.track(router.uncached_blocks(holder, second)):
                assert router.chooser(third)([other, holder]) is holder
        assert holder.in_flight_blocks == 0
        # A prefix nobody holds goes where less work is in flight.
        fresh = PromptBlocks(block_hashes(list(range(50_000, 50_000 + 20 * BLOCK)), BLOCK), BLOCK)
        with holder.track(router.uncached_blocks(holder, fresh)):
            assert router.chooser(fresh)([holder, other]) is other
        await asyncio.gather(*(w.channel.close() for w in (holder, other)))

    asyncio.run(scenario())
