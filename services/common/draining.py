"""Draining: what a worker does between SIGTERM and exit (the code side of a rolling update).

On the first SIGTERM the worker stops admitting work (new calls get UNAVAILABLE, so
the router picks another worker at once), reports unhealthy (the gRPC ``Health``
RPC and HTTP ``/health``), runs the drain hooks (e.g. leaving the worker
registry), and waits until its in-flight calls and KV leases are done or the
drain timeout passes. A second signal cuts the wait short.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable, Iterator

logger = logging.getLogger("cleave.worker")

DrainHook = Callable[[], Awaitable[None]]


class Drain:
    """Admission gate and in-flight count of one worker."""

    def __init__(self) -> None:
        self.draining = False
        self.num_in_flight = 0
        self._hooks: list[DrainHook] = []
        self._changed = asyncio.Event()
        self._force = asyncio.Event()

    @property
    def accepting(self) -> bool:
        return not self.draining

    def on_drain(self, hook: DrainHook) -> None:
        """Run ``hook`` once when draining starts (before waiting), e.g. to deregister."""
        self._hooks.append(hook)

    @contextlib.contextmanager
    def track(self) -> Iterator[None]:
        """Count one admitted call for as long as it runs."""
        self.num_in_flight += 1
        try:
            yield
        finally:
            self.num_in_flight -= 1
            self._changed.set()

    def force(self) -> None:
        """Stop waiting (a second signal)."""
        self._force.set()
        self._changed.set()

    async def drain(self, timeout_s: float, busy: Callable[[], int] = lambda: 0) -> bool:
        """Close the gate and wait for in-flight calls and ``busy()`` to reach 0; True when they did."""
        self.draining = True
        started = time.monotonic()
        logger.info("drain_started in_flight=%d busy=%d timeout_s=%.1f", self.num_in_flight, busy(), timeout_s)
        for hook in self._hooks:
            try:
                await asyncio.wait_for(hook(), timeout=max(timeout_s, 0.1))
            except Exception as e:  # a failing hook must not keep the worker from draining
                logger.warning("drain_hook_failed hook=%r error=%r", hook, e)
        deadline = started + timeout_s
        while (self.num_in_flight or busy()) and not self._force.is_set():
            left = deadline - time.monotonic()
            if left <= 0:
                break
            self._changed.clear()
            with contextlib.suppress(asyncio.TimeoutError):
                # Leases end without a call finishing: poll them too.
                await asyncio.wait_for(self._changed.wait(), timeout=min(left, 0.5))
        done = not (self.num_in_flight or busy())
        logger.info("drain_finished clean=%s in_flight=%d busy=%d seconds=%.2f", done, self.num_in_flight, busy(),
                    time.monotonic() - started)  # fmt: skip
        return done
