"""The engine loop for services: one thread steps the engine continuously, so
requests arriving on many RPCs batch together; asyncio callers stream deltas.

All engine state is touched only on the engine thread: callers submit
commands (plain callables) that run between steps. The one exception is
``run_soon``: while the engine thread computes a step's forward and samples it
(which read only the step's own plan), it leaves the state to a caller, so a
command that needs no step boundary (allocating a KV pull's blocks) runs at
once instead of waiting for the step to end; submitted while the engine thread
holds the state, it runs when the next forward starts if no other command is
ahead of it.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import deque
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

from shared.config import EngineConfig
from shared.engine.engine_core import EngineCore, RequestOutputDelta
from shared.engine.request import Request
from shared.engine.sampling_params import SamplingParams

logger = logging.getLogger("cleave.engine")

IDLE_CHECK_AFTER_S = 0.05  # idle this long (no command, no request) before the block-ownership check


class EngineDeadError(RuntimeError):
    pass


def _deliver(items: list[tuple[asyncio.Queue, RequestOutputDelta]]) -> None:
    for q, delta in items:
        q.put_nowait(delta)


@dataclass
class NewRequest:
    """A request to make on the engine thread in the same command that admits it: one round trip to
    the engine loop (which runs commands only between steps) instead of two."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    prepare: Callable[[Request], None] | None = None  # on the engine thread, between making and admitting


class AsyncEngine:
    def __init__(self, config: EngineConfig, core: EngineCore | None = None) -> None:
        self.core = core or EngineCore(config)
        # (command, its future, whether it may run when a forward starts), in the order submitted.
        self._commands: deque[tuple[Callable[[], Any], Future, bool]] = deque()
        self._commands_lock = threading.Lock()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._wake = threading.Event()
        self._stopped = False
        self.error: BaseException | None = None
        # The last idle-time ownership check's findings ("" while used blocks match their owners).
        self.ownership_error = ""
        self._idle_checked = False
        # Held by the engine thread except while a step's forward runs (see run_soon).
        self._state = threading.Lock()
        self._in_forward = False
        self._thread = threading.Thread(target=self._loop, name="engine-loop", daemon=True)
        self._thread.start()

    @property
    def thread_id(self) -> int:
        """The engine thread's OS id (for its CPU affinity)."""
        assert self._thread.native_id is not None
        return self._thread.native_id

    # ---- engine thread --------------------------------------------------------------------

    def _loop(self) -> None:
        # A step's deltas reach their streams when the next step's forward starts (or before a command
        # runs, or when the engine goes idle): the event loop then streams them while the forward runs
        # native code without the GIL, instead of contending with the step's own Python for it.
        pending: list[RequestOutputDelta] = []

        def flush() -> None:
            if pending:
                self._publish_all(pending)
                pending.clear()

        def open_state() -> None:  # the forward starts: it reads only the step's plan
            flush()
            self._run_commands(soon_only=True)
            self._in_forward = True
            self._state.release()

        def close_state() -> None:  # before the step's outputs update the scheduler
            if self._in_forward:
                self._state.acquire()
                self._in_forward = False

        self._state.acquire()
        try:
            while not self._stopped:
                if self._commands:
                    flush()  # a command (abort, stop) must not overtake the tokens before it
                self._run_commands()
                for request_id in self.core.expire_leases():
                    self._idle_checked = False
                    logger.info("kv_lease_expired request_id=%s", request_id)
                if not self.core.has_unfinished():
                    flush()
                    if self.core.core_share is not None:
                        self.core.core_share.idle()  # a prefill worker's CPUs may be borrowed meanwhile
                    # The check walks every block holding the GIL (milliseconds on a large cache): it waits
                    # for a quiet moment instead of delaying the caller of the command just run, or the
                    # stream of the request that just finished, by that long.
                    if not self._wake.wait(IDLE_CHECK_AFTER_S):
                        self._check_idle()
                    self._wake.clear()
                    continue
                self._idle_checked = False
                started = time.monotonic()
                deltas = self.core.step(before_forward=open_state, after_execute=close_state)
                pending.extend(deltas)
                share = self.core.core_share
                step_s = time.monotonic() - started
                if share is not None and (pause := share.yield_after(step_s, len(self.core.scheduler.running))) > 0.0:
                    flush()  # the step's tokens go out while this worker's CPUs are lent
                    share.idle()
                    self._pause(pause)
        except BaseException as e:  # the loop must never die silently
            logger.exception("engine loop failed")
            self.error = e
            for loop, q in list(self._streams.values()):
                loop.call_soon_threadsafe(q.put_nowait, e)
            self._fail_commands()

    def _pause(self, seconds: float) -> None:
        """Idle for ``seconds`` between steps (see CoreShare.yield_after); commands that arrive meanwhile run
        at once (a new request waits for the next step, not for the pause to end)."""
        deadline = time.monotonic() + seconds
        while not self._stopped and (left := deadline - time.monotonic()) > 0.0:
            if self._wake.wait(left):
                self._wake.clear()
                self._run_commands()

    def _fail_commands(self) -> None:
        """After the loop died: every queued command fails at once (its caller would wait forever)."""
        assert self.error is not None
        while True:
            with self._commands_lock:
                if not self._commands:
                    return
                _, fut, _ = self._commands.popleft()
            if fut.set_running_or_notify_cancel():
                fut.set_exception(EngineDeadError(f"the engine loop stopped: {self.error}"))

    def _check_idle(self) -> None:
        """Once per idle spell: compare used blocks with what requests, leases and pulls hold."""
        if self._idle_checked:
            return
        self._idle_checked = True
        problems = self.core.ownership_problems()
        self.ownership_error = "; ".join(problems[:5])
        if problems:
            logger.error("kv_ownership_violation problems=%d first=%r", len(problems), problems[0])

    def _run_commands(self, soon_only: bool = False) -> None:
        """The queued commands in order; ``soon_only``: those from the front that ``run_soon`` queued (at a
        forward's start, where the others may not run and none may overtake another)."""
        while True:
            with self._commands_lock:
                if not self._commands or (soon_only and not self._commands[0][2]):
                    return
                fn, fut, _ = self._commands.popleft()
            if not fut.set_running_or_notify_cancel():
                continue  # the caller gave up (cancelled RPC): skip the command
            self._idle_checked = False  # a command may change block ownership
            try:
                result = fn()
            except Exception as e:  # the command's own error goes to its caller
                fut.set_exception(e)
            else:
                fut.set_result(result)

    def _publish(self, delta: RequestOutputDelta) -> None:
        self._publish_all([delta])

    def _publish_all(self, deltas: list[RequestOutputDelta]) -> None:
        """Hand a step's deltas to their streams: one wake-up per event loop, not one per delta."""
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue, RequestOutputDelta]]] = {}
        for delta in deltas:
            target = self._streams.get(delta.parent_request_id or delta.request_id)
            if target is not None:
                by_loop.setdefault(target[0], []).append((target[1], delta))
        for loop, items in by_loop.items():
            loop.call_soon_threadsafe(_deliver, items)

    # ---- any thread -----------------------------------------------------------------------

    def call(self, fn: Callable[[], Any], soon: bool = False) -> Future:
        """Run ``fn`` on the engine thread between steps (``soon``: or when a forward starts, see ``run_soon``)."""
        if self.error is not None:
            raise EngineDeadError(f"the engine loop stopped: {self.error}")
        fut: Future = Future()
        with self._commands_lock:
            self._commands.append((fn, fut, soon))
        self._wake.set()
        if self.error is not None:  # the loop died after the check above: it will never run the command
            self._fail_commands()
        return fut

    def submit(self, fn: Callable[[], Any], what: str) -> None:
        """Fire and forget ``fn`` on the engine thread; an exception it raises is logged, not lost."""

        def log_failure(fut: Future) -> None:
            if not fut.cancelled() and fut.exception() is not None:
                logger.error("engine_command_failed command=%s error=%r", what, fut.exception())

        try:
            self.call(fn).add_done_callback(log_failure)
        except EngineDeadError as e:
            logger.warning("engine_command_dropped command=%s error=%s", what, e)

    async def run(self, fn: Callable[[], Any]) -> Any:
        return await asyncio.wrap_future(self.call(fn))

    async def run_soon(self, fn: Callable[[], Any]) -> Any:
        """Run ``fn`` at once on this thread if the engine thread is computing a forward, else on the engine
        thread when the next forward starts or at the step boundary, whichever comes first.

        Only for commands that touch no request of the step in flight and do not change the running
        batch: making a request and allocating blocks for it qualify; admitting, aborting or freeing a
        scheduled request's blocks do not.
        """
        if self.error is None and self._state.acquire(blocking=False):
            try:
                return fn()
            finally:
                self._state.release()
        # The engine thread holds the state: it runs ``fn`` when the next forward starts (the step's
        # sampling and update, or its scheduling, may still be ahead), or at the step boundary if that
        # comes first or another command is queued ahead.
        return await asyncio.wrap_future(self.call(fn, soon=True))

    async def stream(
        self, request: Request | NewRequest, admit: Callable[[Request], None] | None = None, announce: bool = False
    ) -> AsyncGenerator[RequestOutputDelta, None]:
        """Admit ``request`` (default: queue it) and yield its deltas until it finishes. A
        ``NewRequest`` is made in the admitting command; its ``make_request`` errors (InvalidRequestError)
        are raised here, before any delta. ``announce``: first yield one delta without tokens once the
        request is admitted (before the step that computes it ends).

        Leaving the iterator early (client gone, stop string) aborts the request.
        """
        q: asyncio.Queue = asyncio.Queue()
        loop = asyncio.get_running_loop()
        request_id = request.request_id
        n = request.params.n if isinstance(request, NewRequest) else request.sampling_params.n
        num_open = n
        made_here = [not isinstance(request, NewRequest)]  # whether the request exists (else: no abort)

        def admit_now() -> None:
            made = request
            if isinstance(request, NewRequest):  # its id is checked here: registered only once it is ours
                made = self.core.make_request(request.request_id, request.prompt_token_ids, request.params)
                made_here[0] = True
                if request.prepare is not None:
                    request.prepare(made)
            assert isinstance(made, Request)
            # Registered on the engine thread before the request can produce a delta (steps run after this).
            self._streams[request_id] = (loop, q)
            (admit or self.core.scheduler.add_request)(made)

        try:
            try:
                await self.run(admit_now)
            except Exception:
                if not made_here[0]:
                    num_open = 0  # never made: nothing to abort (the id may be another request's)
                raise
            if announce:
                yield RequestOutputDelta(request_id=request_id, new_token_ids=[])
            while num_open:
                item = await q.get()
                if isinstance(item, BaseException):
                    raise EngineDeadError(f"the engine loop stopped: {item}")
                if item.finished:
                    num_open -= 1
                yield item
        finally:
            if self._streams.get(request_id, (None, q))[1] is q:
                self._streams.pop(request_id, None)
            if num_open:
                ids = [request_id] + [f"{request_id}/{i}" for i in range(1, n)]
                self.submit(lambda: [self.core.abort(i) for i in ids], "abort")

    def stop_sample(self, request_id: str) -> bool:
        """End one sample of a forked request early (engine thread: submit with ``call``/``run``).

        The client cut it, e.g. at a stop string: its blocks are freed now and its stream sees it
        finish with reason "stop" while its siblings go on. False if ``request_id`` is no running
        sample of a fork.
        """
        request = self.core.scheduler.requests.get(request_id)
        if request is None or request.pending_children or self.core.beams.owns(request_id):
            return False
        if request.parent_request_id is None and request.sampling_params.n == 1:
            return False  # not a fork: Abort ends the whole request
        self.core.abort(request_id)
        self._publish(
            RequestOutputDelta(
                request_id=request_id,
                new_token_ids=[],
                finished=True,
                finish_reason="stop",
                parent_request_id=request.parent_request_id,
                sample_index=request.seed_offset,
                num_prompt_tokens=request.num_prompt_tokens,
                num_cached_tokens=request.num_cached_tokens,
            )
        )
        return True

    async def generate(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams
    ) -> AsyncIterator[RequestOutputDelta]:
        async for delta in self.stream(NewRequest(request_id, prompt_token_ids, params)):
            yield delta

    def shutdown(self) -> None:
        self._stopped = True
        self._wake.set()
        self._thread.join(timeout=5)
