"""GenerateMany: many Generate calls on one gRPC stream behave as their own RPCs would.

Both ends run for real here: a grpc.aio server on a loopback port whose ``GenerateMany`` is
``serve_calls`` over a scripted ``Generate`` (tokens come from a test-driven "engine step" instead
of a model), and the router's ``GenerateMux`` client over a real channel.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from types import SimpleNamespace

import grpc
import pytest

from services.common.call_mux import BATCH_BYTES, GenerateMux, MuxCall, _take_batch, serve_calls
from services.router.workers import DECODE, WorkerClient
from shared.genproto.cleave.v1 import worker_pb2 as pb
from shared.genproto.cleave.v1 import worker_pb2_grpc


class ScriptedWorker(worker_pb2_grpc.DecodeWorkerServicer):
    """``Generate`` streams ``max_tokens`` tokens ``request_id``-dependent, one per ``step()``; a request id
    starting with ``abort`` aborts, ``raise`` raises and ``forever`` never finishes."""

    def __init__(self) -> None:
        self.queues: dict[str, asyncio.Queue[int]] = {}
        self.cancelled: list[str] = []
        self.metadata: dict[str, dict[str, str]] = {}
        self.num_messages = 0
        self.num_many = 0  # GenerateMany streams opened
        self.closing = asyncio.Event()
        self.advertise = True  # its health answer says it serves GenerateMany

    def step(self) -> None:
        """One engine step: every open call gets its next token at once."""
        for queue in self.queues.values():
            queue.put_nowait(0)

    async def Generate(self, request: pb.GenerateRequest, context) -> AsyncIterator[pb.GenerateResponse]:
        rid = request.request_id
        self.metadata[rid] = dict(context.invocation_metadata())
        if rid.startswith("abort"):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"{rid} is not valid")
        if rid.startswith("raise"):
            raise ValueError("scripted failure")
        queue: asyncio.Queue[int] = asyncio.Queue()
        self.queues[rid] = queue
        base = int(rid.rsplit("-", 1)[-1]) * 100 if rid[-1].isdigit() else 0
        try:
            for i in range(request.sampling.max_tokens):
                await queue.get()
                last = i + 1 == request.sampling.max_tokens and not rid.startswith("forever")
                yield pb.GenerateResponse(
                    tokens=[pb.TokenOutput(token_id=base + i)], finish_reason="length" if last else ""
                )
            if rid.startswith("forever"):
                await asyncio.Event().wait()
        except asyncio.CancelledError:
            self.cancelled.append(rid)
            raise
        finally:
            del self.queues[rid]

    async def Health(self, request, context) -> pb.HealthResponse:
        return pb.HealthResponse(status="ok", role="decode", generate_many=self.advertise)

    async def LoadStats(self, request, context) -> pb.LoadStatsResponse:
        return pb.LoadStatsResponse()

    async def GenerateMany(self, request_iterator, context) -> AsyncIterator[pb.GenerateEvents]:
        self.num_many += 1
        async for message in serve_calls(self.Generate, request_iterator, self.closing):
            self.num_messages += 1
            yield message


async def _start(worker: ScriptedWorker, port: int = 0) -> tuple[grpc.aio.Server, int]:
    server = grpc.aio.server()
    worker_pb2_grpc.add_DecodeWorkerServicer_to_server(worker, server)
    port = server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    return server, port


def _request(rid: str, max_tokens: int = 1) -> pb.GenerateRequest:
    return pb.GenerateRequest(request_id=rid, sampling=pb.SamplingParams(max_tokens=max_tokens))


async def _until(condition, timeout: float = 10.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not condition():
        assert asyncio.get_running_loop().time() < deadline, "condition not reached"
        await asyncio.sleep(0.01)


@asynccontextmanager
async def _live() -> AsyncIterator[SimpleNamespace]:
    """A scripted worker served on a loopback port and a ``GenerateMux`` to it; closed afterwards."""
    worker = ScriptedWorker()
    server, port = await _start(worker)
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    live = SimpleNamespace(worker=worker, server=server, port=port,
                           mux=GenerateMux(worker_pb2_grpc.DecodeWorkerStub(channel)))  # fmt: skip
    try:
        yield live
    finally:
        await live.mux.aclose()
        await channel.close()
        await live.server.stop(None)


def _run(test) -> None:
    """Run ``test(worker, mux)`` against a live server."""

    async def main() -> None:
        async with _live() as live:
            await asyncio.wait_for(test(live.worker, live.mux), timeout=30)

    asyncio.run(main())


async def _collect(call) -> list[int]:
    return [t.token_id async for response in call for t in response.tokens]


def test_calls_share_messages_and_each_gets_its_own_tokens():
    async def test(worker: ScriptedWorker, mux: GenerateMux) -> None:
        num_calls, num_tokens = 8, 12
        calls = [
            mux.generate(_request(f"r-{i}", num_tokens), metadata=(("traceparent", f"tp-{i}"),), timeout=None)
            for i in range(num_calls)
        ]
        results = [asyncio.create_task(_collect(call)) for call in calls]
        await _until(lambda: len(worker.queues) == num_calls)
        for _ in range(num_tokens):
            worker.step()
            await asyncio.sleep(0.01)
        tokens = await asyncio.gather(*results)
        assert tokens == [[i * 100 + j for j in range(num_tokens)] for i in range(num_calls)]
        assert {rid: meta["traceparent"] for rid, meta in worker.metadata.items()} == {
            f"r-{i}": f"tp-{i}" for i in range(num_calls)
        }
        # One message per step (plus the calls' end events), not one per token.
        assert worker.num_messages <= 2 * num_tokens + num_calls < num_calls * num_tokens
        assert mux.num_open == 0

    _run(test)


def test_abort_and_failure_end_only_their_own_call():
    async def test(worker: ScriptedWorker, mux: GenerateMux) -> None:
        good = mux.generate(_request("r-1", 3), (), None)
        collected = asyncio.create_task(_collect(good))
        with pytest.raises(grpc.aio.AioRpcError) as aborted:
            await _collect(mux.generate(_request("abort-2"), (), None))
        assert aborted.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert aborted.value.details() == "abort-2 is not valid"
        with pytest.raises(grpc.aio.AioRpcError) as raised:
            await _collect(mux.generate(_request("raise-3"), (), None))
        assert raised.value.code() == grpc.StatusCode.UNKNOWN
        assert "scripted failure" in raised.value.details()
        await _until(lambda: "r-1" in worker.queues)
        for _ in range(3):
            worker.step()
        assert await collected == [100, 101, 102]

    _run(test)


def test_cancel_and_deadline_reach_the_worker():
    async def test(worker: ScriptedWorker, mux: GenerateMux) -> None:
        call = mux.generate(_request("forever-1", 2), (), None)
        worker_step = asyncio.create_task(_until(lambda: "forever-1" in worker.queues))
        responses = call.__aiter__()
        await worker_step
        worker.step()
        first = await responses.__anext__()
        assert first.tokens[0].token_id == 100
        call.cancel()
        await _until(lambda: "forever-1" in worker.cancelled)

        timed = mux.generate(_request("forever-2", 1), (), timeout=0.2)
        with pytest.raises(grpc.aio.AioRpcError) as expired:
            await _collect(timed)
        assert expired.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        await _until(lambda: "forever-2" in worker.cancelled)

        # The stream still carries new calls.
        after = mux.generate(_request("r-3", 1), (), None)
        collected = asyncio.create_task(_collect(after))
        await _until(lambda: "r-3" in worker.queues)
        worker.step()
        assert await collected == [300]

    _run(test)


def test_a_broken_stream_fails_every_open_call_and_the_next_call_reconnects():
    async def main() -> None:
        async with _live() as live:
            mux, worker = live.mux, live.worker
            calls = [mux.generate(_request(f"forever-{i}", 5), (), None) for i in range(3)]
            results = [asyncio.create_task(_collect(call)) for call in calls]
            await _until(lambda: len(worker.queues) == 3)
            await live.server.stop(None)  # the worker dies with calls open
            for result in results:
                with pytest.raises(grpc.aio.AioRpcError) as broken:
                    await result
                assert broken.value.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED)
            assert mux.num_open == 0

            worker = ScriptedWorker()
            live.server, _ = await _start(worker, live.port)  # it comes back on the same address
            call = mux.generate(_request("r-7", 2), (), timeout=10)
            collected = asyncio.create_task(_collect(call))
            await _until(lambda: "r-7" in worker.queues)
            worker.step()
            worker.step()
            assert await collected == [700, 701]

    asyncio.run(asyncio.wait_for(main(), timeout=60))


def test_closing_ends_the_stream_once_its_calls_have():
    async def test(worker: ScriptedWorker, mux: GenerateMux) -> None:
        call = mux.generate(_request("r-1", 2), (), None)
        collected = asyncio.create_task(_collect(call))
        await _until(lambda: "r-1" in worker.queues)
        worker.closing.set()  # the worker starts draining: the open call still finishes
        worker.step()
        worker.step()
        assert await collected == [100, 101]
        # A call on a stream that closes before taking it fails as a worker that is going away.
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await _collect(mux.generate(_request("r-2", 1), (), None))
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE

    _run(test)


def test_large_responses_are_split_across_messages():
    big = pb.GenerateResponse(prompt_logprobs=[pb.TokenOutput(token_id=i, logprob=-1.0) for i in range(60_000)])
    assert big.ByteSize() > BATCH_BYTES // 2
    outbox = [pb.GenerateCallEvent(call_id=i, response=big) for i in range(4)]
    outbox += [pb.GenerateCallEvent(call_id=9, response=pb.GenerateResponse(tokens=[pb.TokenOutput()]))]
    batches = []
    while outbox:
        batches.append(_take_batch(outbox))
    assert [e.call_id for batch in batches for e in batch] == [0, 1, 2, 3, 9]
    assert len(batches) >= 2
    for batch in batches:
        assert len(batch) == 1 or sum(e.ByteSize() for e in batch) <= BATCH_BYTES


def test_the_router_shares_a_stream_only_with_workers_that_serve_it():
    async def main() -> None:
        async with _live() as live:
            worker = live.worker
            for advertise, per_call, shared in [(True, False, True), (False, False, False), (True, True, False)]:
                worker.advertise = advertise
                client = WorkerClient(f"127.0.0.1:{live.port}", DECODE, per_call_streams=per_call)
                assert await client.poll()
                rid = f"r-{int(advertise)}{int(per_call)}"
                opened = worker.num_many
                call = client.generate(_request(rid, 1), (), timeout=10)
                assert isinstance(call, MuxCall) == shared
                collected = asyncio.create_task(_collect(call))
                await _until(lambda rid=rid: rid in worker.queues)
                worker.step()
                assert len(await collected) == 1
                assert worker.num_many == opened + shared
                await client.close()

    asyncio.run(asyncio.wait_for(main(), timeout=60))
