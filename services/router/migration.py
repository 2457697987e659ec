"""What a decode stream that broke mid-generation needs to go on elsewhere.

A request moves to another decode worker with its prompt plus the tokens the
client already has (``generated_token_ids``); the engine resumes from them, and
seeded sampling draws the same noise for the same output position, so the text
goes on as if nothing happened. A forked request (``n`` samples in one worker
request) moves as one single-sample request per unfinished sample, each with
that sample's seed and tokens so far; ``merge_samples`` streams them back as
the fork's samples.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, Callable
from contextlib import aclosing
from dataclasses import dataclass, field

from services.router.protocol import APIError, wrapped_seed
from shared.genproto.cleave.v1 import worker_pb2

CLEANUP_TIMEOUT_S = 5.0  # how long closing ``merge_samples`` waits for the closed streams' cleanup


@dataclass
class Moves:
    """How far one decode call has travelled: migrations so far, workers that failed it, and why."""

    num_migrations: int = 0
    tried: set[str] = field(default_factory=set)  # addresses
    broken: APIError | None = None  # why the last stream failed, if one did

    def branch(self) -> Moves:
        """The same history for one sample of a fork that goes on alone."""
        return Moves(self.num_migrations, set(self.tried), self.broken)


@dataclass
class Progress:
    """What the client already has of one decode call: each sample's tokens and the finished samples."""

    tokens: dict[int, list[int]]  # sample index -> its tokens so far
    finished: set[int] = field(default_factory=set)
    num_responses: int = 0

    @classmethod
    def of(cls, request: worker_pb2.GenerateRequest) -> Progress:
        if request.sampling.n > 1:
            # A fork's first tokens are drawn on the decode worker (the prefill's one is dropped there).
            return cls({i: [] for i in range(request.sampling.n)})
        first = [request.first_token.token_id] if request.HasField("first_token") else []
        return cls({0: first + list(request.generated_token_ids)})

    def add(self, response: worker_pb2.GenerateResponse) -> None:
        self.num_responses += 1
        self.tokens.setdefault(response.sample_index, []).extend(t.token_id for t in response.tokens)
        if response.finish_reason:
            self.finished.add(response.sample_index)

    def open_samples(self) -> list[int]:
        return [i for i in sorted(self.tokens) if i not in self.finished]


def migrated_request(request: worker_pb2.GenerateRequest, generated: list[int]) -> worker_pb2.GenerateRequest:
    """The same request for another decode worker: prompt plus the tokens the client already has."""
    moved = worker_pb2.GenerateRequest()
    moved.CopyFrom(request)
    moved.ClearField("first_token")
    moved.ClearField("kv_handle")
    moved.announce_admission = False  # the client has the first token
    del moved.generated_token_ids[:]
    moved.generated_token_ids.extend(generated)
    return moved


def sample_id(request_id: str, index: int) -> str:
    """The engine's id of sample ``index`` of fork ``request_id`` (the fork itself is sample 0)."""
    return f"{request_id}/{index}" if index else request_id


def sample_request(fork: worker_pb2.GenerateRequest, index: int, tokens: list[int]) -> worker_pb2.GenerateRequest:
    """Sample ``index`` of ``fork`` as its own request: one sample, that sample's seed, its tokens so far."""
    single = migrated_request(fork, tokens)
    single.request_id = sample_id(fork.request_id, index)
    single.sampling.n = 1
    if single.sampling.HasField("seed"):
        single.sampling.seed = wrapped_seed(single.sampling.seed, index)
    if tokens:
        single.sampling.ClearField("prompt_logprobs")  # the client has them with the sample's first tokens
    return single


async def merge_samples(
    streams: dict[int, AsyncGenerator[worker_pb2.GenerateResponse, None]], ended: Callable[[int], bool]
) -> AsyncGenerator[worker_pb2.GenerateResponse, None]:
    """Every sample's stream at once, as responses come, each marked with its sample index.

    A sample that ``ended`` says is over (the router cut it at a stop string) has its stream closed,
    which aborts its worker request. The first error of any stream is raised; closing this closes all.
    """
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(index: int, stream: AsyncGenerator[worker_pb2.GenerateResponse, None]) -> None:
        try:
            async with aclosing(stream):
                async for response in stream:
                    response.sample_index = index
                    queue.put_nowait(response)
        except Exception as e:  # handed to the consumer, which raises it
            queue.put_nowait(e)

    tasks = {index: asyncio.create_task(pump(index, stream)) for index, stream in streams.items()}
    for task in tasks.values():
        task.add_done_callback(queue.put_nowait)  # however a stream ends, the consumer hears of it
    open_samples = set(tasks)
    try:
        while True:
            for index in [i for i in open_samples if ended(i)]:
                open_samples.discard(index)
                tasks[index].cancel()
            if not open_samples:
                return
            item = await queue.get()
            if isinstance(item, Exception):
                raise item
            if isinstance(item, asyncio.Task):
                index = next(i for i, task in tasks.items() if task is item)
                if index in open_samples and (item.cancelled() or item.exception() is not None):
                    raise RuntimeError(f"the stream of sample {index} ended without a result: {item!r}")
                open_samples.discard(index)
            elif item.sample_index in open_samples:
                yield item
    finally:
        for task in tasks.values():
            task.cancel()
        pending = [task for task in tasks.values() if not task.done()]
        if pending:
            # The streams' cleanup (cancel the calls, abort the worker requests) runs before this returns.
            await asyncio.wait(pending, timeout=CLEANUP_TIMEOUT_S)
