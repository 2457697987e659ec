"""Worker registry in Redis: workers announce themselves, the router reads who is there.

Each worker keeps one hash ``cleave:worker:<worker_id>`` alive with a TTL that a
heartbeat refreshes (every ``HEARTBEAT_S``); a graceful stop deletes it at once,
a killed worker's entry expires after ``TTL_S``. The entry says what the router
needs to route: role, gRPC and metrics address, model, compatibility hash, the
prefix-hash parameters (block size, hash seed), capacity and current load.

Every Redis call has a timeout. When Redis is down, the worker keeps serving
and retries with exponential backoff; the router keeps the last registry it read.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from dataclasses import MISSING, asdict, dataclass, fields
from typing import Any, TypeVar

import redis.asyncio as aioredis

logger = logging.getLogger("cleave.registry")

KEY_PREFIX = "cleave:worker:"
REGISTRY_VERSION = 1
HEARTBEAT_S = 1.0
TTL_S = 4
CALL_TIMEOUT_S = 1.0
MAX_BACKOFF_S = 5.0

T = TypeVar("T")


@dataclass(frozen=True)
class WorkerEntry:
    """One worker as the registry describes it (all fields travel as strings)."""

    worker_id: str
    role: str  # "prefill" or "decode"
    grpc_addr: str
    metrics_addr: str
    model: str
    compat_hash: str
    block_size: int
    hash_seed: str  # hex of the ``extra`` bytes mixed into every block hash ("" for none)
    num_blocks: int
    num_running: int = 0
    num_waiting: int = 0
    kv_cache_usage: float = 0.0
    kv_events: int = 0  # 1: publishes KV events to its stream (see services.common.kv_events)
    version: int = REGISTRY_VERSION

    def to_mapping(self) -> dict[str, str]:
        return {k: str(v) for k, v in asdict(self).items()}

    @classmethod
    def from_mapping(cls, mapping: dict[str, str]) -> WorkerEntry:
        """Parse a Redis hash; raises ValueError/KeyError on a malformed entry."""
        values: dict[str, Any] = {}
        for f in fields(cls):
            if f.name not in mapping:
                if f.default is not MISSING:
                    continue
                raise KeyError(f.name)
            raw = mapping[f.name]
            values[f.name] = int(raw) if f.type == "int" else float(raw) if f.type == "float" else raw
        return cls(**values)


def connect(url: str) -> aioredis.Redis:
    """A client whose every call gives up after ``CALL_TIMEOUT_S`` (no built-in retries)."""
    return aioredis.Redis.from_url(
        url,
        socket_timeout=CALL_TIMEOUT_S,
        socket_connect_timeout=CALL_TIMEOUT_S,
        retry_on_timeout=False,
        decode_responses=True,
    )


async def with_timeout(awaitable: Awaitable[T], timeout_s: float = CALL_TIMEOUT_S * 2) -> T:
    """A second deadline around a Redis call, in case a socket timeout does not fire."""
    return await asyncio.wait_for(awaitable, timeout_s)


REDIS_ERRORS = (aioredis.RedisError, OSError, asyncio.TimeoutError)


class Backoff:
    """Exponential delay between retries after Redis errors, logged once per outage."""

    def __init__(self, what: str, base_s: float) -> None:
        self.what, self.base_s, self.delay_s = what, base_s, base_s
        self.down = False
        self.ever_up = False  # one call has succeeded
        self.num_reconnects = 0  # outages that ended

    @property
    def up(self) -> bool:
        """Redis answered the last call."""
        return self.ever_up and not self.down

    def failed(self, error: BaseException) -> float:
        if not self.down:
            logger.warning("redis_unavailable what=%s error=%r retry_backoff_max_s=%s", self.what, error, MAX_BACKOFF_S)
        self.down = True
        delay, self.delay_s = self.delay_s, min(self.delay_s * 2, MAX_BACKOFF_S)
        return delay

    def succeeded(self) -> float:
        if self.down:
            logger.info("redis_reconnected what=%s", self.what)
            self.num_reconnects += 1
        self.down, self.ever_up, self.delay_s = False, True, self.base_s
        return self.base_s


class WorkerRegistrar:
    """Keeps one worker's entry alive in Redis while it serves."""

    def __init__(self, url: str, describe: Callable[[], WorkerEntry]) -> None:
        self.url = url
        self.describe = describe  # called every heartbeat: load changes
        self.client = connect(url)
        self.num_heartbeats = 0

    def key(self) -> str:
        return KEY_PREFIX + self.describe().worker_id

    async def heartbeat(self) -> None:
        entry = self.describe()
        async with self.client.pipeline(transaction=True) as pipe:
            pipe.hset(KEY_PREFIX + entry.worker_id, mapping=entry.to_mapping())  # type: ignore[arg-type]
            pipe.expire(KEY_PREFIX + entry.worker_id, TTL_S)
            await with_timeout(pipe.execute())
        self.num_heartbeats += 1

    async def run(self) -> None:
        """Heartbeat forever; on Redis errors retry with backoff (the worker keeps serving)."""
        backoff = Backoff(f"register {self.describe().worker_id}", HEARTBEAT_S)
        while True:
            try:
                await self.heartbeat()
                delay = backoff.succeeded()
            except REDIS_ERRORS as e:
                delay = backoff.failed(e)
            await asyncio.sleep(delay)

    async def deregister(self) -> None:
        """Delete the entry now (graceful stop); best effort if Redis is down."""
        try:
            await with_timeout(self.client.delete(self.key()))
            logger.info("worker_deregistered key=%s", self.key())
        except REDIS_ERRORS as e:
            logger.warning("deregister_failed key=%s error=%r", self.key(), e)
        await self.client.aclose()


async def read_registry(client: aioredis.Redis) -> list[WorkerEntry]:
    """Every live, well-formed entry; raises a Redis error if Redis cannot be read."""
    keys = [key async for key in client.scan_iter(match=KEY_PREFIX + "*", count=500)]
    if not keys:
        return []
    async with client.pipeline(transaction=False) as pipe:
        for key in keys:
            pipe.hgetall(key)
        mappings = await pipe.execute()
    entries = []
    for key, mapping in zip(keys, mappings, strict=True):
        if not mapping:
            continue  # expired between SCAN and HGETALL
        try:
            entries.append(WorkerEntry.from_mapping(mapping))
        except (KeyError, ValueError) as e:
            logger.warning("registry_entry_malformed key=%s error=%r", key, e)
    return entries
