"""The router's view of the Redis registry: pools grow and shrink while it serves.

``RegistryWatcher`` reads the registry about every heartbeat and reconciles
both pools with it: a new entry becomes a worker (routed to after its first
successful health poll), an entry that expired or was deleted takes its worker
out of the pool. Workers given as static flags are never removed. A worker
whose compatibility hash differs from its pool's (the hash of the first worker
the pool accepted) is refused, with a log line saying why. When Redis is down
the pools stay as last seen, and the watcher retries with backoff. After an
outage or a Redis restart (a new server ``run_id``), workers get a grace period
to re-register before a missing entry takes them out of their pool.
"""

from __future__ import annotations

import asyncio
import logging
import time

from services.common.registry import (
    HEARTBEAT_S,
    MAX_BACKOFF_S,
    REDIS_ERRORS,
    TTL_S,
    Backoff,
    WorkerEntry,
    connect,
    read_registry,
)
from services.common.registry import with_timeout as redis_timeout
from services.router.workers import WorkerClient, WorkerPool, WorkerPools

logger = logging.getLogger("cleave.router.discovery")

# Long enough for every worker's heartbeat, backing off, to reach a Redis that came back.
REREGISTER_GRACE_S = TTL_S + MAX_BACKOFF_S + 1.0


class RegistryWatcher:
    """Keeps ``pools`` equal to the static workers plus the live registry entries."""

    def __init__(self, url: str, pools: WorkerPools, interval_s: float = HEARTBEAT_S) -> None:
        self.url = url
        self.pools = pools
        self.interval_s = interval_s
        self.client = connect(url)
        self.compat_hash: dict[str, str] = {}  # role -> the hash its pool accepts
        self._refused: set[tuple[str, str]] = set()  # (worker id, hash) already logged
        self.entries: dict[str, WorkerEntry] = {}  # worker id -> last entry read
        self.num_reads = 0
        self._run_id: str | None = None  # the Redis server's; a new one means it restarted empty
        self._grace_until = 0.0  # missing entries do not remove workers before this (monotonic)
        self.backoff = Backoff("router registry watch", interval_s)  # also Redis's state for the metrics

    def pool(self, role: str) -> WorkerPool | None:
        return {"prefill": self.pools.prefill, "decode": self.pools.decode}.get(role)

    async def read_once(self) -> None:
        """One read and reconcile; raises a Redis error if Redis cannot be read."""
        info = await redis_timeout(self.client.info("server"))
        entries = await redis_timeout(read_registry(self.client))
        run_id = str(info.get("run_id", ""))
        if self._run_id is not None and run_id != self._run_id:
            self.start_grace("redis_restarted")
        self._run_id = run_id
        await self.apply(entries)
        self.num_reads += 1

    def start_grace(self, reason: str) -> None:
        logger.info("registry_grace reason=%s seconds=%.0f", reason, REREGISTER_GRACE_S)
        self._grace_until = time.monotonic() + REREGISTER_GRACE_S

    async def run(self) -> None:
        backoff = self.backoff
        while True:
            try:
                await self.read_once()
                delay = backoff.succeeded()
            except REDIS_ERRORS as e:
                delay = backoff.failed(e)  # keep routing on the last registry seen
                self._grace_until = time.monotonic() + REREGISTER_GRACE_S
            except Exception:  # a bug in reconciling must not stop watching
                logger.exception("registry_apply_failed")
                delay = self.interval_s
            await asyncio.sleep(delay)

    def _accepts(self, entry: WorkerEntry) -> bool:
        expected = self.compat_hash.setdefault(entry.role, entry.compat_hash)
        if entry.compat_hash == expected:
            return True
        if (entry.worker_id, entry.compat_hash) not in self._refused:
            self._refused.add((entry.worker_id, entry.compat_hash))
            logger.warning(
                "worker_refused worker_id=%s role=%s address=%s reason=compat_hash_mismatch worker_hash=%s "
                "pool_hash=%s model=%s block_size=%d (start every worker with the same model, --dtype and "
                "--block-size)",
                entry.worker_id, entry.role, entry.grpc_addr, entry.compat_hash, expected, entry.model,
                entry.block_size,
            )  # fmt: skip
        return False

    async def apply(self, entries: list[WorkerEntry]) -> None:
        """Reconcile both pools with ``entries``; new workers are polled before they get requests."""
        live: dict[tuple[str, str], WorkerEntry] = {}
        for entry in sorted(entries, key=lambda e: e.worker_id):
            if self.pool(entry.role) is None or not entry.grpc_addr:
                continue
            if self._accepts(entry):
                live[(entry.role, entry.grpc_addr)] = entry
        in_grace = time.monotonic() < self._grace_until
        if in_grace:  # keep what was known until every worker had time to register again
            kept = {(e.role, e.grpc_addr): e for e in self.entries.values() if (e.role, e.grpc_addr) not in live}
            live = {**kept, **live}
        self.entries = {e.worker_id: e for e in live.values()}
        joined: list[WorkerClient] = []
        for role in ("prefill", "decode"):
            pool = self.pool(role)
            assert pool is not None
            known = {w.address: w for w in pool.workers}
            for (entry_role, address), entry in live.items():
                if entry_role != role:
                    continue
                worker = known.get(address)
                if worker is None:
                    worker = pool.add_worker(address)
                    worker.discovered = True
                    joined.append(worker)
                    logger.info("worker_discovered role=%s address=%s worker_id=%s", role, address, entry.worker_id)
                worker.entry = entry
            for worker in list(pool.workers):
                if worker.discovered and (role, worker.address) not in live:
                    logger.info("worker_forgotten role=%s address=%s reason=registry_entry_gone", role, worker.address)
                    pool.remove_worker(worker)
        if joined:
            await asyncio.gather(*(w.poll() for w in joined))

    async def close(self) -> None:
        await self.client.aclose()
