"""Owners of blocks that no scheduled request holds (torch-free).

At every instant each used KV block belongs to a running (or waiting)
request, a **lease** or a **pull**:

- a lease holds a finished prefill's blocks until a decode worker has pulled
  them, the request is aborted, or the deadline passes. The engine grants it
  in the same step that finishes the prefill, so there is no instant at which
  the blocks belong to no one;
- a pull holds the fresh local blocks a decode worker is copying remote KV
  into, until the request joins the running batch (``hand_over``) or the copy
  is given up (``release``). An abort never frees a pull: the copy may still
  be writing into its blocks.

``ownership_problems`` is the invariant check: the reference count of every
block equals the number of owners listing it, and every owner is known.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from shared.engine.kv_cache_manager import KVCacheManager

LEASE = "lease"
PULL = "pull"


@dataclass(frozen=True)
class Hold:
    kind: str  # LEASE or PULL
    block_ids: tuple[int, ...]
    deadline: float | None  # monotonic seconds; None: no expiry (pulls)


class KVLeases:
    """Request id → hold on the request's blocks in ``kv`` (whose ``req_blocks`` keeps the blocks)."""

    def __init__(self, kv: KVCacheManager) -> None:
        self.kv = kv
        self.holds: dict[str, Hold] = {}
        self.num_expired = 0
        # Kept as counters so that other threads can read them while the engine thread edits ``holds``.
        self.num_leases = 0
        self.num_held_blocks = 0

    def __contains__(self, request_id: str) -> bool:
        return request_id in self.holds

    def get(self, request_id: str) -> Hold | None:
        return self.holds.get(request_id)

    def grant(self, request_id: str, kind: str, deadline: float | None = None) -> Hold:
        """Take over the blocks ``kv`` lists for ``request_id`` (the scheduler no longer owns them)."""
        assert request_id not in self.holds, f"{request_id} is already held"
        hold = Hold(kind, tuple(self.kv.block_ids(request_id)), deadline)
        self.holds[request_id] = hold
        self._count(hold, 1)
        return hold

    def _count(self, hold: Hold, sign: int) -> None:
        self.num_leases += sign * (hold.kind == LEASE)
        self.num_held_blocks += sign * len(hold.block_ids)

    def release(self, request_id: str, kinds: tuple[str, ...] = (LEASE, PULL)) -> bool:
        """Free the blocks of a hold of one of ``kinds``; False if there is none."""
        hold = self.holds.get(request_id)
        if hold is None or hold.kind not in kinds:
            return False
        del self.holds[request_id]
        self._count(hold, -1)
        self.kv.free(request_id)
        return True

    def hand_over(self, request_id: str) -> None:
        """End a pull without freeing: the request (now scheduled) owns its blocks."""
        hold = self.holds.pop(request_id)
        assert hold.kind == PULL, f"{request_id} holds a {hold.kind}, not a pull"
        self._count(hold, -1)

    def expire(self, now: float) -> list[str]:
        """Free every lease whose deadline has passed; returns their request ids."""
        expired = [r for r, h in self.holds.items() if h.deadline is not None and h.deadline < now]
        for request_id in expired:
            self.release(request_id)
        self.num_expired += len(expired)
        return expired


def ownership_problems(kv: KVCacheManager, scheduled_ids: set[str], leases: KVLeases) -> list[str]:
    """Ways in which used blocks differ from what their owners hold; empty when the invariant holds."""
    problems: list[str] = []
    owners = scheduled_ids | set(leases.holds)
    for request_id in kv.req_blocks:
        if request_id not in owners:
            problems.append(f"blocks {kv.block_ids(request_id)} of {request_id!r} have no owner")
    refs = Counter(b.block_id for blocks in kv.req_blocks.values() for b in blocks)
    for block in kv.pool.blocks:
        if block.ref_count != refs.get(block.block_id, 0):
            problems.append(
                f"block {block.block_id} has ref_count {block.ref_count} but {refs.get(block.block_id, 0)} owners"
            )
    num_used = kv.pool.num_blocks - kv.pool.num_free_blocks
    if num_used != len(refs):
        problems.append(f"{num_used} blocks are used but owners hold {len(refs)}")
    return problems
