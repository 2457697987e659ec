"""gRPC clients of the workers and the pools the router chooses from.

A ``WorkerPool`` holds the clients of one role (prefill or decode), polls their
``Health`` and ``LoadStats`` in the background, and picks a worker per call:
``least_loaded`` ranks by the router's own calls in flight plus the worker's
reported queue and KV usage, rotating among equals; ``round_robin`` rotates over
the healthy workers. A worker that refuses a connection is marked unhealthy
until its next successful poll.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from typing import Any

import grpc

from services.common.background import BackgroundTasks
from services.common.call_mux import MAX_MESSAGE_BYTES, GenerateMux, MuxCall
from services.router.metrics import RouterMetrics
from shared.genproto.cleave.v1 import worker_pb2, worker_pb2_grpc

logger = logging.getLogger("cleave.router.workers")

PREFILL = "prefill"
DECODE = "decode"
HEALTH_TIMEOUT_S = 2.0
# A busy worker can answer a poll late; only this many late polls in a row make it unhealthy.
MAX_LATE_POLLS = 3
ABORT_TIMEOUT_S = 5.0
# How soon an on-demand refresh may repeat when no worker is healthy.
MIN_REFRESH_GAP_S = 0.25

# gRPC's default reconnect backoff grows to two minutes, which would hide a worker that
# starts after the router; health polls every few seconds want a prompt retry instead.
CHANNEL_OPTIONS = (
    ("grpc.initial_reconnect_backoff_ms", 500),
    ("grpc.min_reconnect_backoff_ms", 500),
    ("grpc.max_reconnect_backoff_ms", 2000),
    # One GenerateMany message carries a whole step's tokens (and the prompt logprobs of new calls).
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
)


class NoWorkerAvailable(Exception):
    """No healthy, reachable worker of a role; the HTTP edge answers 503."""


class WorkerClient:
    """One worker's channel, stub and last known health and load."""

    def __init__(self, address: str, role: str, per_call_streams: bool = False) -> None:
        self.address = address
        self.role = role
        self.channel = grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS)
        stub_cls = worker_pb2_grpc.PrefillWorkerStub if role == PREFILL else worker_pb2_grpc.DecodeWorkerStub
        # Typed loosely: one client class serves both roles' stubs.
        self.stub: Any = stub_cls(self.channel)
        # Decode calls share one GenerateMany stream (see services.common.call_mux) unless per_call_streams.
        self.mux = GenerateMux(self.stub)
        self.per_call_streams = per_call_streams
        self.generate_many = False  # the worker said it serves GenerateMany
        self.healthy = False
        self.load: worker_pb2.LoadStatsResponse | None = None
        self.max_model_len = 0
        self.worker_id = ""
        self.num_in_flight = 0  # calls this router has open on the worker
        # Start times of those calls, and when the last successful load poll was asked (see num_queued).
        self._open_calls: dict[int, float] = {}
        self._next_call = 0
        self.load_asked_at = 0.0
        self.in_flight_blocks = 0  # KV blocks those calls make the worker compute or hold (kv_aware)
        self.num_late_polls = 0
        self.entry: Any = None  # the registry's WorkerEntry for workers found through Redis
        self.discovered = False  # joined through the registry (so it leaves with its entry)

    async def poll(self) -> bool:
        """Refresh health and load; returns the new health."""
        asked_at = time.monotonic()
        try:
            health = await self.stub.Health(worker_pb2.HealthRequest(), timeout=HEALTH_TIMEOUT_S)
            load = await self.stub.LoadStats(worker_pb2.LoadStatsRequest(), timeout=HEALTH_TIMEOUT_S)
        except grpc.aio.AioRpcError as e:
            if e.code() == grpc.StatusCode.DEADLINE_EXCEEDED and self.healthy:
                self.num_late_polls += 1
                if self.num_late_polls < MAX_LATE_POLLS:
                    return True  # slow under load, not gone: keep routing to it
            if self.healthy:
                logger.warning("worker_unhealthy role=%s address=%s code=%s", self.role, self.address, e.code().name)
            self.healthy = False
            return False
        self.num_late_polls = 0
        ok = health.status == "ok" and health.role in ("", self.role)
        if not ok and self.healthy:
            logger.warning(
                "worker_unhealthy role=%s address=%s status=%s reported_role=%s",
                self.role,
                self.address,
                health.status,
                health.role,
            )
        elif ok and not self.healthy:
            logger.info("worker_healthy role=%s address=%s worker_id=%s", self.role, self.address, health.worker_id)
        self.healthy = ok
        self.load = load
        self.load_asked_at = asked_at
        self.max_model_len = health.max_model_len
        self.worker_id = health.worker_id
        self.generate_many = health.generate_many
        return ok

    def generate(self, request: worker_pb2.GenerateRequest, metadata, timeout: float | None) -> MuxCall | Any:
        """A ``Generate`` call on this decode worker: iterate it for responses, ``cancel()`` it when leaving."""
        if self.per_call_streams or not self.generate_many:
            return self.stub.Generate(request, metadata=metadata, timeout=timeout)
        return self.mux.generate(request, metadata, timeout)

    async def close(self) -> None:
        await self.mux.aclose()
        await self.channel.close()

    def mark_unreachable(self) -> None:
        if self.healthy:
            logger.warning("worker_unreachable role=%s address=%s", self.role, self.address)
        self.healthy = False

    def load_score(self) -> tuple[int, float]:
        waiting = self.load.num_waiting if self.load else 0
        usage = self.load.kv_cache_usage if self.load else 0.0
        return (self.num_in_flight + waiting, usage)

    @property
    def num_queued(self) -> int:
        """The worker's queue as this router can tell: the requests waiting there at the last load poll,
        plus this router's calls sent since that poll and still open, which the poll could not see
        (several routers in front of one pool, or a burst between polls, are both counted)."""
        waiting = self.load.num_waiting if self.load else 0
        return waiting + sum(1 for started in self._open_calls.values() if started >= self.load_asked_at)

    @contextmanager
    def track(self, num_blocks: int = 0) -> Iterator[None]:
        """Count a call (and the KV blocks it costs) as in flight on this worker for load balancing."""
        call, self._next_call = self._next_call, self._next_call + 1
        self._open_calls[call] = time.monotonic()
        self.num_in_flight += 1
        self.in_flight_blocks += num_blocks
        try:
            yield
        finally:
            del self._open_calls[call]
            self.num_in_flight -= 1
            self.in_flight_blocks -= num_blocks


class WorkerPool:
    """The workers of one role."""

    def __init__(
        self, role: str, addresses: tuple[str, ...], policy: str, metrics: RouterMetrics, per_call_streams: bool = False
    ) -> None:
        self.role = role
        self.policy = policy
        self.metrics = metrics
        self.per_call_streams = per_call_streams
        self.workers = [WorkerClient(addr, role, per_call_streams) for addr in addresses]
        self._cursor = 0
        self._refresh_lock = asyncio.Lock()
        self._last_refresh = 0.0
        self._background = BackgroundTasks()  # best-effort aborts, releases, channel closes

    def __bool__(self) -> bool:
        return bool(self.workers)

    def healthy_workers(self) -> list[WorkerClient]:
        return [w for w in self.workers if w.healthy]

    async def refresh(self, min_age_s: float = 0.0) -> None:
        """Poll every worker once, concurrently, unless the last poll is younger than ``min_age_s``."""
        async with self._refresh_lock:
            if min_age_s and time.monotonic() - self._last_refresh < min_age_s:
                return
            await asyncio.gather(*(w.poll() for w in self.workers))
            self._last_refresh = time.monotonic()
            for w in self.workers:
                self.metrics.worker_healthy.labels(self.role, w.address).set(1 if w.healthy else 0)

    async def health_loop(self, interval_s: float) -> None:
        while True:
            await asyncio.sleep(interval_s)
            try:
                await self.refresh()
            except Exception:  # a poll bug must not stop polling
                logger.exception("health_poll_failed role=%s", self.role)

    async def pick(
        self, exclude: set[str] | None = None, choose: Callable[[list[WorkerClient]], WorkerClient] | None = None
    ) -> WorkerClient:
        """A healthy worker not in ``exclude`` (addresses); polls once on demand if none is known healthy.

        ``choose`` (kv_aware routing) picks among the candidates, given in rotated order.
        """
        exclude = exclude or set()
        candidates = [w for w in self.healthy_workers() if w.address not in exclude]
        if not candidates and self.workers:
            await self.refresh(min_age_s=MIN_REFRESH_GAP_S)
            candidates = [w for w in self.healthy_workers() if w.address not in exclude]
        if not candidates:
            self.metrics.routing_decisions.labels(self.role, self.policy, "no_worker").inc()
            if not self.workers:
                raise NoWorkerAvailable(
                    f"no {self.role} workers are configured; start the router with --{self.role}-worker HOST:PORT"
                )
            raise NoWorkerAvailable(
                f"no {self.role} worker is available ({len(self.workers)} configured, none healthy and reachable); "
                "retry later"
            )
        start = self._cursor % len(candidates)
        self._cursor += 1
        rotated = candidates[start:] + candidates[:start]
        self.metrics.routing_decisions.labels(self.role, self.policy, "picked").inc()
        if choose is not None:
            return choose(rotated)
        if self.policy == "round_robin":
            return rotated[0]
        return min(rotated, key=WorkerClient.load_score)

    def add_worker(self, address: str) -> WorkerClient:
        """A worker that joined (found in the registry); unhealthy until its first poll."""
        worker = WorkerClient(address, self.role, self.per_call_streams)
        self.workers.append(worker)
        return worker

    def remove_worker(self, worker: WorkerClient) -> None:
        """Stop routing to ``worker``; its channel closes once this router's calls on it end."""
        self.workers = [w for w in self.workers if w is not worker]
        try:
            self.metrics.worker_healthy.remove(self.role, worker.address)
        except KeyError:
            pass

        async def close_when_idle() -> None:
            deadline = time.monotonic() + 600
            while worker.num_in_flight and time.monotonic() < deadline:
                await asyncio.sleep(0.5)
            await worker.close()

        self.spawn(close_when_idle(), "close_channel")

    def spawn(self, coro: Awaitable[object], what: str) -> None:
        """Run a best-effort call (abort, release) detached from the request's cancellation."""

        async def runner() -> None:
            try:
                await coro
            except grpc.aio.AioRpcError as e:
                logger.debug("%s_failed role=%s code=%s", what, self.role, e.code().name)

        self._background.spawn(runner(), what)

    def abort(
        self, worker: WorkerClient, request_id: str, metadata: tuple[tuple[str, str], ...], sample_only: bool = False
    ) -> None:
        """Abort a request on ``worker`` (in the background); ``sample_only``: just that sample of a fork."""
        req = worker_pb2.AbortRequest(request_id=request_id, sample_only=sample_only)
        self.spawn(worker.stub.Abort(req, metadata=metadata, timeout=ABORT_TIMEOUT_S), "abort")

    def release_kv(self, worker: WorkerClient, request_id: str, metadata: tuple[tuple[str, str], ...]) -> None:
        req = worker_pb2.ReleaseKVRequest(request_id=request_id)
        self.spawn(worker.stub.ReleaseKV(req, metadata=metadata, timeout=ABORT_TIMEOUT_S), "release_kv")

    async def close(self) -> None:
        await self._background.wait(ABORT_TIMEOUT_S)
        await asyncio.gather(*(w.close() for w in self.workers))


class WorkerPools:
    """The prefill and decode pools plus their health polling tasks."""

    def __init__(
        self,
        prefill_addrs: tuple[str, ...],
        decode_addrs: tuple[str, ...],
        policy: str,
        metrics: RouterMetrics,
        per_call_streams: bool = False,
    ) -> None:
        self.prefill = WorkerPool(PREFILL, prefill_addrs, policy, metrics)
        self.decode = WorkerPool(DECODE, decode_addrs, policy, metrics, per_call_streams)
        self._tasks: list[asyncio.Task] = []

    async def start(self, interval_s: float) -> None:
        await asyncio.gather(self.prefill.refresh(), self.decode.refresh())
        for pool in (self.prefill, self.decode):
            # Also for an empty pool: workers found through the registry join later.
            self._tasks.append(asyncio.create_task(pool.health_loop(interval_s)))

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await asyncio.gather(self.prefill.close(), self.decode.close())

    def smallest_max_model_len(self) -> int:
        """Smallest context length a healthy worker reported (0 if none reported one)."""
        lengths = [w.max_model_len for w in self.prefill.workers + self.decode.workers if w.healthy and w.max_model_len]
        return min(lengths, default=0)
