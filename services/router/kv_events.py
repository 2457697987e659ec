"""The router's reader of the workers' KV event streams, feeding the ``KVIndex``.

For every registered worker that publishes events, the reader follows its
stream with ``XREAD`` and applies each batch in sequence order. A batch
numbered below the next expected one is already reflected and skipped; one
above it means events were lost (Redis down, stream trimmed past the reader),
and the worker's entries are rebuilt from its ``ListCachedBlocks`` snapshot.
After a Redis error every stream is re-read from its start (Redis may have
restarted empty); sequence numbers make that safe.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from typing import Any

import grpc

from services.common.kv_events import STREAM_PREFIX, EventBatch, stream_key
from services.common.registry import REDIS_ERRORS, Backoff, connect, with_timeout
from services.router.discovery import RegistryWatcher
from services.router.kv_index import KVIndex
from shared.genproto.cleave.v1 import worker_pb2

logger = logging.getLogger("cleave.router.kv_events")

READ_BLOCK_MS = 200
READ_COUNT = 1000
SNAPSHOT_TIMEOUT_S = 5.0
RESYNC_RETRY_S = 1.0


@dataclass
class StreamState:
    last_id: str = "0-0"
    next_seq: int | None = None  # None: unknown until a ``cleared`` batch or a snapshot
    last_resync: float = 0.0  # monotonic time of the last snapshot attempt


class KVEventReader:
    def __init__(self, url: str, watcher: RegistryWatcher, index: KVIndex) -> None:
        self.watcher = watcher
        self.index = index
        self.client = connect(url)
        self.streams: dict[str, StreamState] = {}  # worker id -> position
        self.num_batches = 0
        self.num_resyncs = 0
        self.backoff = Backoff("router kv events", READ_BLOCK_MS / 1000)  # also Redis's state for the metrics

    def _sync_workers(self) -> None:
        live = {wid for wid, entry in self.watcher.entries.items() if entry.kv_events}
        for worker_id in list(self.streams):
            if worker_id not in live:
                del self.streams[worker_id]
                self.index.clear_worker(worker_id)
        for worker_id in live:
            self.streams.setdefault(worker_id, StreamState())

    async def read_once(self) -> None:
        """One ``XREAD`` over every stream, applied; raises a Redis error if Redis cannot be read."""
        self._sync_workers()
        if not self.streams:
            await asyncio.sleep(READ_BLOCK_MS / 1000)
            return
        for worker_id, known in self.streams.items():
            # A worker whose position is unknown may publish nothing for a long time: ask it now.
            if known.next_seq is None and time.monotonic() - known.last_resync > RESYNC_RETRY_S:
                await self.resync(worker_id, known)
        positions = {stream_key(wid): state.last_id for wid, state in self.streams.items()}
        reply: Any = await with_timeout(self.client.xread(positions, count=READ_COUNT, block=READ_BLOCK_MS))  # type: ignore[arg-type]
        for key, messages in reply or []:
            worker_id = key[len(STREAM_PREFIX) :]
            state = self.streams.get(worker_id)
            if state is None:
                continue
            for message_id, fields in messages:
                state.last_id = message_id
                await self.apply(worker_id, state, EventBatch.from_fields(fields))

    async def apply(self, worker_id: str, state: StreamState, batch: EventBatch) -> None:
        self.num_batches += 1
        if batch.cleared:
            self.index.clear_worker(worker_id)
        elif state.next_seq is None or batch.seq > state.next_seq:
            await self.resync(worker_id, state)
            return  # the snapshot reflects this batch: it was drained before the snapshot was taken
        elif batch.seq < state.next_seq:
            return
        self.index.remove(worker_id, batch.removed)
        self.index.store(worker_id, batch.stored)
        state.next_seq = batch.seq + 1

    async def resync(self, worker_id: str, state: StreamState) -> None:
        """Rebuild a worker's entries from its snapshot; on failure, try again later."""
        state.last_resync = time.monotonic()
        entry = self.watcher.entries.get(worker_id)
        pool = self.watcher.pool(entry.role) if entry else None
        worker = next((w for w in pool.workers if w.address == entry.grpc_addr), None) if pool and entry else None
        if worker is None:
            return
        try:
            snap = await worker.stub.ListCachedBlocks(worker_pb2.ListCachedBlocksRequest(), timeout=SNAPSHOT_TIMEOUT_S)
        except grpc.aio.AioRpcError as e:
            logger.info("kv_snapshot_failed worker_id=%s code=%s", worker_id, e.code().name)
            state.next_seq = None
            return
        self.index.clear_worker(worker_id)
        self.index.store(worker_id, snap.block_hashes)
        state.next_seq = snap.event_seq + 1
        self.num_resyncs += 1
        logger.info(
            "kv_index_resynced worker_id=%s blocks=%d seq=%d", worker_id, len(snap.block_hashes), snap.event_seq
        )

    async def run(self) -> None:
        backoff = self.backoff
        while True:
            try:
                await self.read_once()
                backoff.succeeded()
                continue
            except REDIS_ERRORS as e:
                delay = backoff.failed(e)
                for state in self.streams.values():
                    state.last_id = "0-0"  # Redis may come back empty; sequence numbers skip what was seen
            except Exception:  # a bug in one batch must not stop the index
                logger.exception("kv_event_apply_failed")
                delay = 1.0
            await asyncio.sleep(delay)

    async def close(self) -> None:
        await self.client.aclose()
