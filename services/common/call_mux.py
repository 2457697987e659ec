"""Many ``Generate`` calls over one gRPC stream (``GenerateMany``), both ends.

A token streamed as its own gRPC message costs both processes about 0.1 ms of CPU (an HTTP/2
frame, a completion-queue event and a coroutine wake-up on each side); after a decode step of
64 sequences that is 64 messages. Over ``GenerateMany`` the worker sends what all its open calls
produced since its previous message as one message: one per engine step.

Each call carried on the stream keeps the behaviour of its own ``Generate`` RPC: the worker runs
the same servicer method for it, with a context whose ``abort`` ends only that call, and the
router's ``MuxCall`` iterates responses, raises ``grpc.aio.AioRpcError`` with the call's status,
honours a deadline and cancels. The stream breaking (the worker died) ends every call on it with
the stream's status; the next call opens a new stream. The router uses the stream only with a
worker whose health answer says it serves ``GenerateMany``; other workers get plain ``Generate`` RPCs.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from contextlib import aclosing
from typing import Any

import grpc

from shared.genproto.cleave.v1 import worker_pb2 as pb

logger = logging.getLogger("cleave.call_mux")

# A message of the stream stops growing at this size (prompt logprobs and embeddings are large);
# the router's channel accepts messages up to MAX_MESSAGE_BYTES.
BATCH_BYTES = 1 << 20
MAX_MESSAGE_BYTES = 64 << 20

OK = grpc.StatusCode.OK.value[0]
_CODES = {code.value[0]: code for code in grpc.StatusCode}


class CallAborted(Exception):
    """``abort`` on a carried call's context: ends that call with ``code``."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(details)
        self.code = code
        self.details = details


class CarriedContext:
    """What a servicer method reads from its context, for one call carried by ``GenerateMany``."""

    def __init__(self, metadata: tuple[tuple[str, str], ...]) -> None:
        self._metadata = metadata

    def invocation_metadata(self) -> tuple[tuple[str, str], ...]:
        return self._metadata

    async def abort(self, code: grpc.StatusCode, details: str = "") -> None:
        raise CallAborted(code, details)


Generate = Callable[[pb.GenerateRequest, Any], AsyncGenerator[pb.GenerateResponse, None]]


async def serve_calls(
    generate: Generate, calls: AsyncIterator[pb.GenerateCall], closing: asyncio.Event | None = None
) -> AsyncIterator[pb.GenerateEvents]:
    """The worker's ``GenerateMany``: run each call as ``generate(request, context)`` and send what every
    open call has produced in one message whenever the stream can take one. Once ``closing`` is set
    (the worker drains) the stream ends as soon as no call is open on it."""
    outbox: list[pb.GenerateCallEvent] = []
    ready = asyncio.Event()
    running: dict[int, asyncio.Task] = {}
    reading = True
    closing = closing or asyncio.Event()

    def post(event: pb.GenerateCallEvent) -> None:
        outbox.append(event)
        ready.set()

    async def run(call: pb.GenerateCall) -> None:
        context = CarriedContext(tuple((m.key, m.value) for m in call.metadata))
        code, details = OK, ""
        try:
            async with aclosing(generate(call.request, context)) as responses:
                async for response in responses:
                    post(pb.GenerateCallEvent(call_id=call.call_id, response=response))
        except CallAborted as e:
            code, details = e.code.value[0], e.details
        except Exception as e:  # what grpc would answer for a servicer that raised
            logger.exception("generate_failed call_id=%d request_id=%s", call.call_id, call.request.request_id)
            code, details = grpc.StatusCode.UNKNOWN.value[0], f"Unexpected {type(e).__name__}: {e}"
        finally:
            running.pop(call.call_id, None)
        # (A cancelled call raised past this: the router has dropped it already.)
        post(pb.GenerateCallEvent(call_id=call.call_id, ended=True, status_code=code, status_details=details))

    async def read() -> None:
        nonlocal reading
        try:
            async for call in calls:
                if call.cancel:
                    task = running.pop(call.call_id, None)
                    if task is not None:
                        task.cancel()
                elif call.call_id not in running:
                    running[call.call_id] = asyncio.create_task(run(call), name=f"generate-{call.call_id}")
        finally:
            reading = False
            ready.set()

    async def close() -> None:
        await closing.wait()
        ready.set()

    reader = asyncio.create_task(read(), name="generate-many-reader")
    closer = asyncio.create_task(close(), name="generate-many-closer")
    try:
        while (reading and not closing.is_set()) or running or outbox:
            await ready.wait()
            ready.clear()
            while outbox:
                yield pb.GenerateEvents(events=_take_batch(outbox))
        if not reading:
            await reader  # surfaces a failed read
    finally:
        tasks = [reader, closer, *running.values()]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def _take_batch(outbox: list[pb.GenerateCallEvent]) -> list[pb.GenerateCallEvent]:
    """The events that go in the next message, taken off ``outbox``: all of them unless large
    responses (prompt logprobs, embeddings) would make it bigger than BATCH_BYTES."""
    size = 0
    for i, event in enumerate(outbox):
        response = event.response
        if response.prompt_logprobs or response.embedding:
            size += event.ByteSize()
            if size > BATCH_BYTES and i > 0:
                batch, outbox[:] = outbox[:i], outbox[i:]
                return batch
    batch = outbox[:]
    outbox.clear()
    return batch


class MuxCall:
    """One ``Generate`` call as the router sees it: iterate for responses; ``cancel()`` ends it."""

    def __init__(self, mux: GenerateMux, request: pb.GenerateRequest, metadata, timeout: float | None) -> None:
        self._mux = mux
        self.request = request
        self.metadata = metadata
        self._events: asyncio.Queue[pb.GenerateCallEvent | grpc.aio.AioRpcError] = asyncio.Queue()
        self._done = False
        self.call_id = -1
        self._expiry: asyncio.TimerHandle | None = None
        if timeout is not None:
            self._expiry = asyncio.get_running_loop().call_later(timeout, self._expire)
        mux.open(self)

    def deliver(self, item: pb.GenerateCallEvent | grpc.aio.AioRpcError) -> None:
        self._events.put_nowait(item)

    def _expire(self) -> None:
        if not self._done:
            self._mux.cancel(self)
            self.deliver(_error(grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded"))

    def __aiter__(self) -> AsyncIterator[pb.GenerateResponse]:
        return self._responses()

    async def _responses(self) -> AsyncIterator[pb.GenerateResponse]:
        try:
            while True:
                item = await self._events.get()
                if isinstance(item, grpc.aio.AioRpcError):
                    self._done = True
                    raise item
                if item.ended:
                    self._done = True
                    if item.status_code != OK:
                        raise _error(_CODES.get(item.status_code, grpc.StatusCode.UNKNOWN), item.status_details)
                    return
                yield item.response
        finally:
            if self._expiry is not None:
                self._expiry.cancel()

    def cancel(self) -> None:
        """End the call at the worker (its request is aborted there) unless it already ended."""
        if not self._done:
            self._mux.cancel(self)
        self._done = True
        if self._expiry is not None:
            self._expiry.cancel()


class GenerateMux:
    """The router's ``GenerateMany`` stream to one decode worker, opened when a call needs it."""

    def __init__(self, stub: Any) -> None:
        self.stub = stub
        self._calls: dict[int, MuxCall] = {}
        self._next_id = 0
        self._outgoing: asyncio.Queue[pb.GenerateCall] | None = None
        self._reader: asyncio.Task | None = None

    def generate(self, request: pb.GenerateRequest, metadata=(), timeout: float | None = None) -> MuxCall:
        return MuxCall(self, request, metadata, timeout)

    @property
    def num_open(self) -> int:
        return len(self._calls)

    def open(self, call: MuxCall) -> None:
        if self._outgoing is None:
            outgoing: asyncio.Queue[pb.GenerateCall] = asyncio.Queue()
            self._outgoing = outgoing
            self._reader = asyncio.create_task(self._read(outgoing), name="generate-many")
        call.call_id, self._next_id = self._next_id, self._next_id + 1
        self._calls[call.call_id] = call
        meta = [pb.MetadataEntry(key=k, value=v) for k, v in call.metadata or () if isinstance(v, str)]
        self._outgoing.put_nowait(pb.GenerateCall(call_id=call.call_id, request=call.request, metadata=meta))

    def cancel(self, call: MuxCall) -> None:
        """Forget ``call`` here and tell the worker to end it (unless it ended or its stream broke)."""
        if self._calls.pop(call.call_id, None) is not None and self._outgoing is not None:
            self._outgoing.put_nowait(pb.GenerateCall(call_id=call.call_id, cancel=True))

    async def _read(self, outgoing: asyncio.Queue[pb.GenerateCall]) -> None:
        async def requests() -> AsyncIterator[pb.GenerateCall]:
            while True:
                yield await outgoing.get()

        stream = self.stub.GenerateMany(requests())
        error = _error(grpc.StatusCode.UNAVAILABLE, "the worker ended the GenerateMany stream")
        try:
            async for message in stream:
                for event in message.events:
                    call = self._calls.get(event.call_id)
                    if call is None:
                        continue  # cancelled here already
                    if event.ended:
                        del self._calls[event.call_id]
                    call.deliver(event)
        except grpc.aio.AioRpcError as e:
            # A stream that fails in the transport (INTERNAL: a call's message sent as the worker closed the
            # stream) ends its calls as a worker that went away, which the router retries elsewhere; a
            # call's own status comes as an event, not as the stream's.
            error = _error(grpc.StatusCode.UNAVAILABLE, f"GenerateMany stream failed: {e.details()}") if (
                e.code() == grpc.StatusCode.INTERNAL) else e  # fmt: skip
            logger.info("generate_many_broken code=%s calls=%d details=%s", e.code().name, len(self._calls),
                        e.details())  # fmt: skip
        except asyncio.CancelledError:
            stream.cancel()
            raise
        finally:
            # Every call still open ends with the stream; the next call opens a new one.
            if self._outgoing is outgoing:
                self._outgoing = None
                self._reader = None
            calls, self._calls = self._calls, {}
            for call in calls.values():
                call.deliver(error)

    async def aclose(self) -> None:
        reader = self._reader
        if reader is not None:
            reader.cancel()
            await asyncio.gather(reader, return_exceptions=True)


def _error(code: grpc.StatusCode, details: str) -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details)
