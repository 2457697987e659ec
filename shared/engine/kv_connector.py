"""Remote KV entering the engine: the KV connector (torch-free).

Two sides, as in vLLM's connector API:

- ``KVConnectorScheduler`` runs on the engine thread. Given what a remote
  worker holds for a request (``RemoteKV``), it matches the local prefix cache
  first, says how many further tokens the remote can supply, allocates local
  blocks for them and returns the ``KVLoad`` to perform: only the remote blocks
  the local cache lacks. Meanwhile a pull hold (``KVLeases``) owns the blocks.
  Once the load is done it hands them to the request, which joins the running
  batch; if the load is given up it frees them.
- ``KVConnectorWorker`` moves the bytes through a ``KVTransport`` (the
  service's NIXL or TCP connector): start the load, wait for it, release the
  remote blocks. A load of no blocks finishes at once without touching the
  transport.

Services call these; they do not edit the KV manager or the scheduler.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Protocol

from shared.engine.kv_cache_manager import KVCacheManager, cdiv
from shared.engine.kv_leases import PULL, KVLeases
from shared.engine.request import Request
from shared.engine.sampling_params import InvalidRequestError
from shared.engine.scheduler import Scheduler


@dataclass(frozen=True)
class RemoteKV:
    """The KV a remote worker holds for a request: ``block_ids[i]`` holds tokens ``[i*bs, (i+1)*bs)``."""

    remote_request_id: str
    peer_id: str  # the transport's name for the remote worker
    endpoint: str  # where to send the release (the remote worker's address)
    block_ids: tuple[int, ...]
    num_tokens: int  # prompt tokens whose KV the blocks hold


@dataclass(frozen=True)
class KVLoad:
    """One planned load: copy ``remote_block_ids`` into ``local_block_ids`` (same length, same order)."""

    request_id: str
    remote: RemoteKV
    remote_block_ids: tuple[int, ...]
    local_block_ids: tuple[int, ...]
    num_local_tokens: int  # prompt tokens the local prefix cache already held
    num_remote_tokens: int  # tokens the load supplies on top of them

    @property
    def num_blocks(self) -> int:
        return len(self.remote_block_ids)


@dataclass(frozen=True)
class LoadResult:
    num_bytes: int
    seconds: float
    num_descriptors: int


class KVTransport(Protocol):
    """What the worker side needs from a transfer backend (the service supplies it)."""

    def pull(self, peer_id: str, remote_block_ids: list[int], local_block_ids: list[int]) -> LoadResult:
        """Copy remote blocks into local ones; blocking; raises on failure."""
        ...

    def release(self, remote: RemoteKV) -> None:
        """Tell the remote worker its blocks are no longer needed; must not block."""
        ...


class KVConnectorScheduler:
    """Engine-thread side: what a remote can supply, what to allocate, when the request runs."""

    def __init__(self, kv: KVCacheManager, scheduler: Scheduler, leases: KVLeases) -> None:
        self.kv = kv
        self.scheduler = scheduler
        # While a load runs, a PULL hold owns the request's blocks (local cache hits included).
        self.leases = leases
        # Prompt tokens loads found in the local prefix cache (not pulled). Kept apart from the
        # prefix-cache hit stats: such a hit saves a transfer, the prefill was computed remotely.
        self.num_local_hit_tokens = 0

    def get_num_new_matched_tokens(self, request: Request, remote: RemoteKV, num_computed_tokens: int) -> int:
        """Tokens the remote supplies beyond the ``num_computed_tokens`` the request holds locally."""
        return max(0, remote.num_tokens - num_computed_tokens)

    def allocate(self, request: Request, remote: RemoteKV) -> KVLoad | None:
        """Match the local prefix cache, allocate blocks for the rest of the remote KV; None if blocks run short.

        Raises InvalidRequestError when ``remote`` cannot describe this request's prompt.
        """
        self._check(request, remote)
        assert request.num_computed_tokens == 0 and request.request_id not in self.kv.req_blocks
        hits, num_local = self.kv.get_computed_blocks(request, record=False)
        num_local = min(num_local, remote.num_tokens // self.kv.block_size * self.kv.block_size)
        hits = hits[: num_local // self.kv.block_size]
        num_new = self.get_num_new_matched_tokens(request, remote, num_local)
        request.num_computed_tokens = num_local
        block_ids = self.kv.allocate_slots(request, num_new, hits)
        if block_ids is None:
            request.num_computed_tokens = 0
            return None
        self.leases.grant(request.request_id, PULL)
        self.num_local_hit_tokens += num_local
        first = len(hits)  # remote block index where the local cache stops
        return KVLoad(
            request_id=request.request_id,
            remote=remote,
            remote_block_ids=tuple(remote.block_ids[first:]),
            local_block_ids=tuple(block_ids[first : len(remote.block_ids)]),
            num_local_tokens=num_local,
            num_remote_tokens=num_new,
        )

    def _check(self, request: Request, remote: RemoteKV) -> None:
        if not 0 < remote.num_tokens < request.num_tokens:
            raise InvalidRequestError(
                f"remote KV covers {remote.num_tokens} tokens; a request of {request.num_tokens} tokens "
                "(prompt and first token) takes between 1 and all but its last token"
            )
        if len(remote.block_ids) != cdiv(remote.num_tokens, self.kv.block_size):
            raise InvalidRequestError(
                f"remote KV of {remote.num_tokens} tokens comes in {len(remote.block_ids)} blocks; "
                f"blocks of {self.kv.block_size} tokens need {cdiv(remote.num_tokens, self.kv.block_size)}"
            )

    def finish_load(self, request: Request, load: KVLoad) -> None:
        """The loaded KV is in place: the request joins the running batch after its remote tokens."""
        self.leases.hand_over(request.request_id)
        request.num_computed_tokens = load.num_local_tokens + load.num_remote_tokens
        # Local matches saved a transfer, not compute: the prompt's cached tokens are the prefill
        # worker's to report (its prefix-cache hit), so none are counted here.
        request.num_cached_tokens = 0
        self.kv.cache_full_blocks(request)
        self.scheduler.add_running(request)

    def free_unjoined(self, request: Request) -> None:
        """Give back the blocks of a load whose request never joined (failed, cancelled). Idempotent."""
        if self.leases.release(request.request_id, kinds=(PULL,)):
            request.num_computed_tokens = 0


class KVConnectorWorker:
    """Transfer side: loads run on a small thread pool, off the engine thread and the event loop."""

    def __init__(self, transport: KVTransport, max_concurrent_loads: int = 4) -> None:
        self.transport = transport
        self._pool = ThreadPoolExecutor(max_concurrent_loads, thread_name_prefix="kv-load")

    def start_load(self, load: KVLoad) -> Future[LoadResult]:
        """Begin copying the load's blocks; a load of no blocks is done at once, with no transfer."""
        if not load.num_blocks:
            done: Future[LoadResult] = Future()
            done.set_result(LoadResult(num_bytes=0, seconds=0.0, num_descriptors=0))
            return done
        return self._pool.submit(
            self.transport.pull, load.remote.peer_id, list(load.remote_block_ids), list(load.local_block_ids)
        )

    @staticmethod
    def wait_for_load(future: Future[LoadResult], timeout: float | None = None) -> LoadResult:
        """Block until the load is done; re-raises the transport's error."""
        return future.result(timeout)

    def release_remote(self, remote: RemoteKV) -> None:
        """The remote blocks are no longer needed (loaded, or given up)."""
        self.transport.release(remote)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
