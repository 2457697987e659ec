"""Fixed-size KV blocks: free list, reference counts, prefix-cache index (torch-free).

A block whose reference count drops to zero goes to the back of the free
queue. If it carries a full-block hash it stays findable in the prefix cache
until it is handed out again (LRU eviction from the front of the queue).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass


@dataclass(eq=False)
class KVBlock:
    block_id: int
    ref_count: int = 0
    block_hash: bytes | None = None


@dataclass(frozen=True)
class BlockEvent:
    kind: str  # "stored" or "evicted"
    block_hash: bytes


class BlockPool:
    def __init__(self, num_blocks: int, enable_caching: bool = True, record_events: bool = False) -> None:
        if num_blocks < 1:
            raise ValueError(f"the KV cache needs at least one block, got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        # Blocks with ref_count 0, oldest first: popping from the front evicts the LRU one.
        self._free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self._cached: dict[bytes, KVBlock] = {}
        # Stored/evicted events for a consumer that drains them (a KV-event publisher);
        # off by default, so that nothing accumulates without one.
        self.record_events = record_events
        self.events: list[BlockEvent] = []
        self.cache_queries = 0  # blocks looked up
        self.cache_hits = 0  # blocks found

    @property
    def num_free_blocks(self) -> int:
        """Blocks that can be handed out now: free or evictable."""
        return len(self._free)

    @property
    def num_cached_blocks(self) -> int:
        return len(self._cached)

    @property
    def usage(self) -> float:
        return 1.0 - self.num_free_blocks / self.num_blocks

    def get_new_blocks(self, count: int) -> list[KVBlock] | None:
        """``count`` blocks with ref_count 1, evicting cached ones LRU-first; None if short."""
        if count > len(self._free):
            return None
        out = []
        for _ in range(count):
            block_id, _ = self._free.popitem(last=False)
            block = self.blocks[block_id]
            self._evict(block)
            assert block.ref_count == 0
            block.ref_count = 1
            out.append(block)
        return out

    def lookup(self, block_hash: bytes, record: bool = True) -> KVBlock | None:
        """The cached block holding ``block_hash``; ``record`` counts the query and hit in the cache stats."""
        block = self._cached.get(block_hash)
        if record:
            self.cache_queries += 1
            self.cache_hits += block is not None
        return block

    def touch(self, blocks: list[KVBlock]) -> None:
        """Take a reference on cache hits (removing them from the free queue)."""
        for block in blocks:
            if block.ref_count == 0:
                del self._free[block.block_id]
            block.ref_count += 1

    def free(self, blocks: list[KVBlock]) -> None:
        """Drop one reference each; pass blocks tail-first so tails are evicted first."""
        for block in blocks:
            assert block.ref_count > 0, f"block {block.block_id} freed twice"
            block.ref_count -= 1
            if block.ref_count == 0:
                self._free[block.block_id] = None

    def cache_block(self, block: KVBlock, block_hash: bytes) -> None:
        """Register a full, computed block under its chained hash."""
        if not self.enable_caching or block.block_hash is not None:
            return
        if block_hash in self._cached:
            return  # the same content is already cached in another block
        block.block_hash = block_hash
        self._cached[block_hash] = block
        if self.record_events:
            self.events.append(BlockEvent("stored", block_hash))

    def _evict(self, block: KVBlock) -> None:
        if block.block_hash is None:
            return
        if self._cached.get(block.block_hash) is block:
            del self._cached[block.block_hash]
            if self.record_events:
                self.events.append(BlockEvent("evicted", block.block_hash))
        block.block_hash = None

    def reset_prefix_cache(self) -> None:
        for block in self.blocks:
            if block.ref_count == 0:
                self._evict(block)

    def cached_hashes(self) -> list[bytes]:
        """Every hash the prefix cache holds now (a snapshot for KV-event consumers)."""
        return list(self._cached)

    def drain_events(self) -> list[BlockEvent]:
        events, self.events = self.events, []
        return events
