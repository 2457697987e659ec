"""KV events: what a worker's prefix cache gains and loses, published to a Redis Stream.

The engine's block pool records ``stored``/``evicted`` events while a publisher
is attached. About every ``BATCH_S`` the publisher drains them on the engine
thread (so one batch covers whole engine steps), gives the batch the next
sequence number and appends it to the worker's stream
``cleave:kv:<worker_id>`` (trimmed to about ``STREAM_MAXLEN`` entries). The
first batch says ``cleared``: a consumer drops what it knew of the worker.

A batch that cannot be published (Redis down) still used its number, so a
consumer sees the gap (after a failure the publisher keeps sending, empty
batches included, until one arrives) and asks ``ListCachedBlocks`` for a snapshot, which
reflects every batch numbered up to the snapshot's ``event_seq``.

Stream entry fields (strings): ``seq``, ``cleared`` ("1"/"0"), ``block_size``,
``stored`` and ``removed`` (32-hex-digit hashes, concatenated, in event order).
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass

from services.common.registry import REDIS_ERRORS, Backoff, connect, with_timeout
from shared.engine.async_engine import AsyncEngine

logger = logging.getLogger("cleave.kv_events")

STREAM_PREFIX = "cleave:kv:"
STREAM_MAXLEN = 10_000
BATCH_S = 0.05
HASH_HEX = 32  # 16-byte block hashes


@dataclass(frozen=True)
class EventBatch:
    seq: int
    cleared: bool
    block_size: int
    stored: list[bytes]
    removed: list[bytes]

    def to_fields(self) -> dict[str, str]:
        return {
            "seq": str(self.seq),
            "cleared": "1" if self.cleared else "0",
            "block_size": str(self.block_size),
            "stored": b"".join(self.stored).hex(),
            "removed": b"".join(self.removed).hex(),
        }

    @classmethod
    def from_fields(cls, fields: dict[str, str]) -> EventBatch:
        def split(text: str) -> list[bytes]:
            return [bytes.fromhex(text[i : i + HASH_HEX]) for i in range(0, len(text), HASH_HEX)]

        return cls(int(fields["seq"]), fields.get("cleared") == "1", int(fields.get("block_size", 0)),
                   split(fields.get("stored", "")), split(fields.get("removed", "")))  # fmt: skip


def stream_key(worker_id: str) -> str:
    return STREAM_PREFIX + worker_id


class KVEventPublisher:
    """Drains the engine's block events and appends them, numbered, to this worker's stream."""

    def __init__(self, url: str, engine: AsyncEngine, worker_id: str) -> None:
        self.engine = engine
        self.key = stream_key(worker_id)
        self.client = connect(url)
        self.last_seq = 0  # the number of the last batch drained (published or lost)
        self.num_lost = 0

    def _drain(self, first: bool, force: bool = False) -> EventBatch | None:
        """Engine thread: the events since the last drain as the next batch (None if nothing happened,
        unless ``force``)."""
        pool = self.engine.core.kv.pool
        if first:
            pool.record_events = True
            pool.drain_events()
        events = pool.drain_events()
        if not events and not first and not force:
            return None
        self.last_seq += 1
        stored = [e.block_hash for e in events if e.kind == "stored"]
        removed = [e.block_hash for e in events if e.kind != "stored"]
        if first:  # everything before this batch is forgotten; the cache's content now is in ``stored``
            stored, removed = pool.cached_hashes(), []
        return EventBatch(self.last_seq, first, self.engine.core.kv.block_size, stored, removed)

    def snapshot(self) -> tuple[list[bytes], int]:
        """Engine thread: the cached hashes and the last batch number they reflect."""
        return self.engine.core.kv.pool.cached_hashes(), self.last_seq

    async def run(self) -> None:
        backoff = Backoff(f"kv events {self.key}", BATCH_S)
        first = True
        while True:
            # While batches are being lost, publish even empty ones: the first to arrive shows the gap.
            force = backoff.down
            batch = await self.engine.run(lambda: self._drain(first, force))  # noqa: B023 (read at once)
            first = False
            delay = BATCH_S
            if batch is not None:
                try:
                    await with_timeout(self.client.xadd(self.key, batch.to_fields(), maxlen=STREAM_MAXLEN))  # type: ignore[arg-type]
                    backoff.succeeded()
                except REDIS_ERRORS as e:
                    self.num_lost += 1  # its number is used: consumers see a gap and take a snapshot
                    delay = max(backoff.failed(e), BATCH_S)
            await asyncio.sleep(delay)

    async def close(self) -> None:
        await self.client.aclose()
