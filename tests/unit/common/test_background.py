"""Background tasks are held until they end, and what they raise is logged."""

from __future__ import annotations

import asyncio
import gc
import logging

from services.common.background import BackgroundTasks


def test_tasks_are_held_and_failures_logged(caplog):
    async def main() -> None:
        tasks = BackgroundTasks()
        finished = asyncio.Event()

        async def slow() -> None:
            await asyncio.sleep(0.01)
            finished.set()

        async def broken() -> None:
            raise RuntimeError("release went wrong")

        tasks.spawn(slow(), "slow")
        tasks.spawn(broken(), "broken")
        gc.collect()  # nothing else references the tasks: the set must keep them alive
        assert len(tasks) == 2
        await asyncio.wait_for(finished.wait(), timeout=10)
        await tasks.wait(timeout=10)
        await asyncio.sleep(0)  # done-callbacks run on the next loop turn
        assert len(tasks) == 0

        forever = tasks.spawn(asyncio.sleep(3600), "forever")
        await tasks.close(timeout=10)
        assert forever.cancelled() and len(tasks) == 0

    with caplog.at_level(logging.ERROR, logger="cleave.background"):
        asyncio.run(main())
    failures = [r for r in caplog.records if "background_task_failed" in r.getMessage()]
    assert len(failures) == 1 and "task=broken" in failures[0].getMessage()
    assert "release went wrong" in failures[0].getMessage()
