"""Fire-and-forget asyncio tasks that are kept referenced and whose failures are logged.

The event loop holds only weak references to tasks: a task nobody keeps can be
garbage-collected mid-flight, and an exception nobody retrieves is reported
late or never. ``BackgroundTasks`` keeps each task until it ends and logs what
it raised.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Coroutine
from typing import Any

logger = logging.getLogger("cleave.background")


class BackgroundTasks:
    """A set of running tasks; ``spawn`` from the event loop's thread."""

    def __init__(self) -> None:
        self._tasks: set[asyncio.Task] = set()

    def __len__(self) -> int:
        return len(self._tasks)

    def spawn(self, coro: Coroutine[Any, Any, Any], name: str) -> asyncio.Task:
        """Start ``coro`` as a task held until it ends."""
        return self.adopt(asyncio.get_running_loop().create_task(coro, name=name))

    def adopt(self, task: asyncio.Task) -> asyncio.Task:
        """Hold a task made elsewhere, and log what it raises."""
        self._tasks.add(task)
        task.add_done_callback(self._done)
        return task

    def _done(self, task: asyncio.Task) -> None:
        self._tasks.discard(task)
        if task.cancelled():
            return
        error = task.exception()
        if error is not None:
            logger.error("background_task_failed task=%s error=%r", task.get_name(), error, exc_info=error)

    async def wait(self, timeout: float) -> None:
        """Let what runs finish, for at most ``timeout`` seconds (nothing is cancelled)."""
        if self._tasks:
            await asyncio.wait(list(self._tasks), timeout=timeout)

    async def close(self, timeout: float = 5.0) -> None:
        """Cancel what still runs and wait (at most ``timeout`` seconds) for it to end."""
        for task in list(self._tasks):
            task.cancel()
        await self.wait(timeout)
