"""The router's index of every worker's cached KV blocks: block hash -> worker ids.

``KVIndex`` is pure bookkeeping with a memory bound: past ``max_entries``
(hash, worker) pairs in all, the oldest stored entries go first (what a
worker stored longest ago is what its LRU evicts first). ``prefix_overlap``
counts the leading blocks of a prompt a worker holds: a cached block only
helps while every block before it is cached too.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Iterable, Sequence

DEFAULT_MAX_ENTRIES = 1_000_000


class KVIndex:
    def __init__(self, max_entries: int = DEFAULT_MAX_ENTRIES) -> None:
        self.max_entries = max_entries
        self._holders: dict[bytes, set[str]] = {}
        # One queue for all workers, oldest first: (hash, worker id) -> None.
        self._order: OrderedDict[tuple[bytes, str], None] = OrderedDict()
        self._by_worker: dict[str, set[bytes]] = {}
        self.num_dropped = 0  # entries dropped to stay within max_entries

    def __len__(self) -> int:
        return len(self._order)

    def store(self, worker_id: str, hashes: Iterable[bytes]) -> None:
        held = self._by_worker.setdefault(worker_id, set())
        for block_hash in hashes:
            key = (block_hash, worker_id)
            if key in self._order:
                self._order.move_to_end(key)
                continue
            self._order[key] = None
            held.add(block_hash)
            self._holders.setdefault(block_hash, set()).add(worker_id)
        while len(self._order) > self.max_entries:
            (block_hash, holder), _ = self._order.popitem(last=False)
            self._forget(block_hash, holder)
            self.num_dropped += 1

    def remove(self, worker_id: str, hashes: Iterable[bytes]) -> None:
        for block_hash in hashes:
            key = (block_hash, worker_id)
            if key in self._order:
                del self._order[key]
                self._forget(block_hash, worker_id)

    def clear_worker(self, worker_id: str) -> None:
        for block_hash in self._by_worker.pop(worker_id, set()):
            self._order.pop((block_hash, worker_id), None)
            holders = self._holders.get(block_hash)
            if holders is not None:
                holders.discard(worker_id)
                if not holders:
                    del self._holders[block_hash]

    def _forget(self, block_hash: bytes, worker_id: str) -> None:
        self._by_worker.get(worker_id, set()).discard(block_hash)
        holders = self._holders.get(block_hash)
        if holders is not None:
            holders.discard(worker_id)
            if not holders:
                del self._holders[block_hash]

    def worker_hashes(self, worker_id: str) -> set[bytes]:
        return set(self._by_worker.get(worker_id, ()))

    def prefix_overlap(self, hashes: Sequence[bytes]) -> dict[str, int]:
        """Worker id -> how many leading blocks of ``hashes`` it holds (workers with none left out)."""
        overlap: dict[str, int] = {}
        alive: set[str] | None = None
        for i, block_hash in enumerate(hashes):
            holders = self._holders.get(block_hash)
            if not holders:
                break
            alive = set(holders) if alive is None else alive & holders
            if not alive:
                break
            for worker_id in alive:
                overlap[worker_id] = i + 1
        return overlap

    def summary(self) -> dict:
        """Entries in all, and per worker its block count and ``hashes_digest`` of its hashes."""
        workers = {wid: {"blocks": len(held), "digest": hashes_digest(held)} for wid, held in self._by_worker.items()}
        return {"entries": len(self), "dropped": self.num_dropped, "workers": workers}


def hashes_digest(hashes: Iterable[bytes]) -> str:
    """Order-free digest of a set of block hashes (to compare an index with a worker's cache)."""
    h = hashlib.blake2b(digest_size=16)
    for block_hash in sorted(set(hashes)):
        h.update(block_hash)
    return h.hexdigest()
