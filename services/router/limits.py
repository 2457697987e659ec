"""Limits and access at the HTTP edge: API key, backpressure, whole-request deadline.

- ``--api-key``: every ``/v1/*`` request needs ``Authorization: Bearer <key>``,
  compared in constant time; ``/health`` and ``/metrics`` stay open.
- ``--max-queued-requests``: when every healthy worker of a pool already has
  that many requests queued (``WorkerClient.num_queued``: its reported queue plus
  this router's calls sent since that report), a new request gets 429 with
  ``Retry-After`` instead of queueing without bound.
- ``--request-timeout``: a request (a whole stream included) that runs longer
  gets 504, or an error event in its stream, and its worker calls are cancelled.
"""

from __future__ import annotations

import asyncio
import hmac
import time
from collections.abc import AsyncGenerator
from typing import TypeVar

from services.router.metrics import RouterMetrics
from services.router.protocol import APIError
from services.router.workers import WorkerPools

T = TypeVar("T")

RETRY_AFTER_S = 1


def api_key_error(authorization: str | None, api_key: str) -> APIError | None:
    """None if ``authorization`` carries the key; else the 401 to answer."""
    scheme, _, token = (authorization or "").partition(" ")
    if not authorization:
        return APIError(401, "missing API key: send the header 'Authorization: Bearer <key>'", code="invalid_api_key")
    if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), api_key.encode()):
        return APIError(401, "invalid API key", code="invalid_api_key")
    return None


def overload_error(pools: WorkerPools, max_queued: int, metrics: RouterMetrics | None = None) -> APIError | None:
    """429 when every healthy worker of a pool in use has ``max_queued`` requests queued
    (counted in ``metrics`` by the pool's role)."""
    if max_queued <= 0:
        return None
    for pool in (pools.decode, pools.prefill):
        healthy = pool.healthy_workers()
        if healthy and all(w.num_queued >= max_queued for w in healthy):
            if metrics is not None:
                metrics.rejected.labels(pool.role).inc()
            return APIError(
                429,
                f"every {pool.role} worker has {max_queued} requests queued (--max-queued-requests); retry in "
                f"{RETRY_AFTER_S}s",
                "rate_limit_error",
                code="rate_limit_exceeded",
            )
    return None


def retry_after_headers(error: APIError) -> dict[str, str]:
    return {"retry-after": str(RETRY_AFTER_S)} if error.status_code == 429 else {}


def timeout_error(timeout_s: float) -> APIError:
    return APIError(504, f"the request ran longer than --request-timeout ({timeout_s:g}s)", "timeout_error")


async def with_deadline(
    events: AsyncGenerator[T, None], timeout_s: float | None, metrics: RouterMetrics | None = None
) -> AsyncGenerator[T, None]:
    """``events`` until ``timeout_s`` have passed, then a 504 ``APIError`` (``events`` is closed;
    the timeout is counted in ``metrics``)."""
    if not timeout_s:
        async for item in events:
            yield item
        return
    deadline = time.monotonic() + timeout_s
    try:
        while True:
            try:
                item = await asyncio.wait_for(anext(events), max(deadline - time.monotonic(), 0.0))
            except StopAsyncIteration:
                return
            except TimeoutError:
                if metrics is not None:
                    metrics.timeouts.inc()
                raise timeout_error(timeout_s) from None
            yield item
    finally:
        await events.aclose()
