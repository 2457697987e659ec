"""Which asyncio event loop the services run on.

uvloop (libuv) where it is installed: its transports write a socket and run a
callback in C, and every token a service streams costs a socket write (the
router's SSE chunk, a worker's gRPC message). ``CLEAVE_EVENT_LOOP=asyncio``
keeps the standard loop.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

T = TypeVar("T")

CHOICES = ("auto", "uvloop", "asyncio")


def loop_name() -> str:
    """The loop that ``CLEAVE_EVENT_LOOP`` (auto, uvloop or asyncio) picks on this machine: uvloop or asyncio."""
    choice = os.environ.get("CLEAVE_EVENT_LOOP", "auto").strip().lower() or "auto"
    if choice not in CHOICES:
        raise ValueError(f"CLEAVE_EVENT_LOOP={choice!r}: expected one of {', '.join(CHOICES)}")
    if choice == "asyncio":
        return "asyncio"
    try:
        import uvloop  # noqa: F401
    except ImportError:
        if choice == "uvloop":
            raise ValueError("CLEAVE_EVENT_LOOP=uvloop, but uvloop is not installed (pip install uvloop)") from None
        return "asyncio"
    return "uvloop"


def run(main: Coroutine[Any, Any, T], loop: str) -> T:
    """``asyncio.run`` on ``loop`` (what ``loop_name`` picked)."""
    factory: Callable[[], asyncio.AbstractEventLoop] | None = None
    if loop == "uvloop":
        import uvloop

        factory = uvloop.new_event_loop
    with asyncio.Runner(loop_factory=factory) as runner:
        return runner.run(main)
