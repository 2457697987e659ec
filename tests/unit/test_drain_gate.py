"""The drain gate on its own: hooks run first, waiting ends when calls finish, at the deadline or on force."""

from __future__ import annotations

import asyncio
import time

from services.common.draining import Drain


def test_waits_for_in_flight_calls_and_runs_hooks_first() -> None:
    async def scenario() -> tuple[bool, list[str]]:
        drain, events = Drain(), []

        async def hook() -> None:
            events.append(f"hook accepting={drain.accepting}")

        drain.on_drain(hook)

        async def call() -> None:
            with drain.track():
                await asyncio.sleep(0.2)
                events.append("call done")

        task = asyncio.create_task(call())
        await asyncio.sleep(0.01)
        clean = await drain.drain(timeout_s=10)
        await task
        return clean, events

    clean, events = asyncio.run(scenario())
    assert clean and events == ["hook accepting=False", "call done"]


def test_deadline_and_busy_count() -> None:
    async def scenario() -> tuple[bool, float]:
        drain = Drain()
        started = time.monotonic()
        clean = await drain.drain(timeout_s=0.3, busy=lambda: 1)  # a lease that never ends
        return clean, time.monotonic() - started

    clean, seconds = asyncio.run(scenario())
    assert not clean and 0.3 <= seconds < 5


def test_force_stops_waiting_and_failing_hook_does_not_block() -> None:
    async def scenario() -> bool:
        drain = Drain()

        async def broken() -> None:
            raise RuntimeError("registry down")

        drain.on_drain(broken)
        with drain.track():
            asyncio.get_running_loop().call_later(0.1, drain.force)
            return await drain.drain(timeout_s=30)

    assert asyncio.run(scenario()) is False
