"""Per-request block tables over the block pool (torch-free).

Handles prefix-cache lookups, slot allocation with copy-on-write for blocks
shared after an ``n > 1`` fork, registration of newly full blocks, and freeing.
"""

from __future__ import annotations

from shared.engine.block_pool import BlockPool, KVBlock
from shared.engine.request import Request


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True) -> None:
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.pool = BlockPool(num_blocks, enable_caching)
        self.req_blocks: dict[str, list[KVBlock]] = {}
        self._num_hashed: dict[str, int] = {}  # leading blocks already registered in the cache
        # Each request's block ids as allocate_slots returns them: a new list whenever its blocks change
        # (never mutated after it is handed out), so a decode step whose token fits the last block
        # returns it as it is instead of reading every block again.
        self._ids: dict[str, list[int]] = {}
        self._pending_copies: list[tuple[int, int]] = []

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    def block_ids(self, request_id: str) -> list[int]:
        return [b.block_id for b in self.req_blocks.get(request_id, ())]

    def get_computed_blocks(self, request: Request, record: bool = True) -> tuple[list[KVBlock], int]:
        """Longest cached prefix of the request, in blocks and tokens.

        At least one token is always left to compute, since the last prompt
        position's logits are needed to sample. ``record=False`` leaves the
        hit-rate stats alone (a lookup that saves a transfer, not compute).
        """
        params = request.sampling_params
        if not self.enable_caching or params.prompt_logprobs is not None or params.pooling == "mean":
            return [], 0  # prompt logprobs and mean pooling need every prompt position computed
        max_blocks = (request.num_tokens - 1) // self.block_size
        hits: list[KVBlock] = []
        for block_hash in request.block_hashes(self.block_size)[:max_blocks]:
            block = self.pool.lookup(block_hash, record)
            if block is None:
                break
            hits.append(block)
        return hits, len(hits) * self.block_size

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        computed_blocks: list[KVBlock] | None = None,
    ) -> list[int] | None:
        """Make room for ``num_new_tokens`` more tokens; None (and no change) if blocks run short.

        ``computed_blocks`` are prefix-cache hits (first schedule only); the
        request's ``num_computed_tokens`` must already count them.
        """
        request_id = request.request_id
        num_total_tokens = request.num_computed_tokens + num_new_tokens
        if not computed_blocks:
            held = self.req_blocks.get(request_id)
            # The common decode step: the new tokens fit the blocks held, the last of which is not shared.
            if held and num_total_tokens <= len(held) * self.block_size:
                if not self._needs_copy_on_write(request, held):
                    return self._ids[request_id]
        computed_blocks = computed_blocks or []
        blocks = self.req_blocks.get(request_id, [])
        num_needed = cdiv(num_total_tokens, self.block_size) - len(blocks) - len(computed_blocks)
        cow = self._needs_copy_on_write(request, blocks)
        num_evictable_hits = sum(1 for b in computed_blocks if b.ref_count == 0)
        if max(num_needed, 0) + cow + num_evictable_hits > self.pool.num_free_blocks:
            return None
        self.pool.touch(computed_blocks)
        blocks = self.req_blocks.setdefault(request.request_id, [])
        blocks.extend(computed_blocks)
        if computed_blocks:
            self._num_hashed[request.request_id] = len(blocks)
        if cow:
            self._copy_on_write(blocks)
        if num_needed > 0:
            new = self.pool.get_new_blocks(num_needed)
            assert new is not None
            blocks.extend(new)
        ids = self._ids[request_id] = [b.block_id for b in blocks]
        return ids

    def _needs_copy_on_write(self, request: Request, blocks: list[KVBlock]) -> bool:
        """The next token lands in a partly filled block that another request shares."""
        offset = request.num_computed_tokens % self.block_size
        if offset == 0 or not blocks:
            return False
        last = blocks[request.num_computed_tokens // self.block_size]
        return last.ref_count > 1

    def _copy_on_write(self, blocks: list[KVBlock]) -> None:
        # The shared block is the last one (only it can be partial).
        shared = blocks[-1]
        new = self.pool.get_new_blocks(1)
        assert new is not None
        self.pool.free([shared])
        blocks[-1] = new[0]
        self._pending_copies.append((shared.block_id, new[0].block_id))

    def take_pending_copies(self) -> list[tuple[int, int]]:
        """(src, dst) block copies the model runner must do before the next forward."""
        copies, self._pending_copies = self._pending_copies, []
        return copies

    def cache_full_blocks(self, request: Request) -> None:
        """Register the request's newly full and computed blocks in the prefix cache."""
        if not self.enable_caching:
            return
        start = self._num_hashed.get(request.request_id, 0)
        if request.num_computed_tokens // self.block_size <= start:
            return  # no block filled since the last call (most decode steps)
        blocks = self.req_blocks.get(request.request_id)
        if not blocks:
            return
        num_full = min(request.num_computed_tokens // self.block_size, len(blocks))
        if num_full <= start:
            return
        hashes = request.block_hashes(self.block_size)
        for i in range(start, num_full):
            self.pool.cache_block(blocks[i], hashes[i])
        self._num_hashed[request.request_id] = num_full

    def fork(self, parent: Request, child: Request) -> None:
        """Share every parent block with ``child`` (copy-on-write on the next write)."""
        blocks = self.req_blocks.get(parent.request_id, [])
        self.pool.touch(blocks)
        self.req_blocks[child.request_id] = list(blocks)
        self._ids[child.request_id] = self.block_ids(child.request_id)
        self._num_hashed[child.request_id] = self._num_hashed.get(parent.request_id, 0)

    def free(self, request_id: str) -> None:
        blocks = self.req_blocks.pop(request_id, None)
        self._num_hashed.pop(request_id, None)
        self._ids.pop(request_id, None)
        if blocks:
            self.pool.free(list(reversed(blocks)))
