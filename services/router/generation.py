"""The request pipeline: worker calls, detokenization, stop strings, fan-out of choices.

One choice (of ``n``, of each prompt) is one worker request. Disaggregated:
``Prefill`` on a prefill worker gives the first token and a KV handle, then
``Generate`` on a decode worker continues from that handle. Aggregated (no
prefill pool, no healthy prefill worker, a single-token request or a prompt
under ``disagg_min_prompt_tokens``): ``Generate`` alone. On the disaggregated
path the decode stream carries only the tokens after ``first_token``, which the
router already has from the prefill worker and sends on once the decode worker
announces that it queued the request (``--first-token-at decode``: the client's
stream then starts at the decode worker's pace, without the hand-off's pause
after the first token) or at once (``prefill``). A ``ChoiceDecoder``
turns token batches into text deltas; ``run_choices`` runs the choices as tasks
and yields their deltas in arrival order, cancelling everything when its
consumer stops (stop string, client gone), which aborts the worker requests.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import AsyncGenerator, Callable, Sequence
from contextlib import aclosing
from dataclasses import dataclass, field

import grpc
from opentelemetry.context import Context

from services.common.convert import constraint_to_proto, set_token_controls
from services.router.kv_routing import Chooser, KVRouter, PromptBlocks
from services.router.metrics import RequestTimer, RouterMetrics
from services.router.migration import Moves, Progress, merge_samples, migrated_request, sample_id, sample_request
from services.router.protocol import APIError, choice_params
from services.router.workers import NoWorkerAvailable, WorkerClient, WorkerPool, WorkerPools
from shared.engine.sampling_params import SamplingParams
from shared.genproto.cleave.v1 import worker_pb2
from shared.tokenizer import IncrementalDetokenizer, Tokenizer, find_stop, holdback_len
from shared.tracing import Tracing

logger = logging.getLogger("cleave.router.generation")

Metadata = tuple[tuple[str, str], ...]
CLEANUP_TIMEOUT_S = 5.0  # how long closing run_choices waits for the cancelled choices' cleanup


@dataclass(frozen=True)
class ChoiceSpec:
    """One worker request: choice ``index`` of the HTTP request."""

    index: int
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    tokens_as_ids: bool = False  # return_tokens_as_token_ids: logprob tokens read "token_id:N"


@dataclass(frozen=True)
class CallContext:
    """What every worker call of one HTTP request shares."""

    pools: WorkerPools
    metadata: Metadata
    rpc_timeout_s: float
    disagg_min_prompt_tokens: int
    metrics: RouterMetrics
    timer: RequestTimer
    kv_router: KVRouter | None = None  # kv_aware routing (with --redis-url)
    migration_limit: int = 3  # times a stream may move to another decode worker

    tracing: Tracing | None = None
    trace_parent: Context | None = None  # holds the request's span: parent of the route spans
    # Disaggregated: the prefill's first token goes out once the decode worker has queued the request (its
    # announcement), not at once (--first-token-at).
    first_token_at_decode: bool = False
    # Samples of forked requests the router cut (stop strings): their worker ends them at once.
    cut_samples: set[str] = field(default_factory=set)
    ended_samples: set[str] = field(default_factory=set)  # every sample cut so far (cut_samples empties)


@dataclass
class Route:
    """Where kv_aware routing sends one choice: the prompt's blocks and the decode worker it prefers."""

    blocks: PromptBlocks
    decode_worker: WorkerClient
    decode_overlap: int

    def uncached_blocks(self, ctx: CallContext, worker: WorkerClient) -> int:
        assert ctx.kv_router is not None
        return ctx.kv_router.uncached_blocks(worker, self.blocks)


async def _pick(
    ctx: CallContext, pool: WorkerPool, tried: set[str] | None, choose: Chooser | None = None
) -> WorkerClient:
    """``pool.pick`` inside a ``route`` span when tracing."""
    if ctx.tracing is None:
        return await pool.pick(tried, choose)
    with ctx.tracing.span(
        "route", ctx.trace_parent, attributes={"cleave.pool": pool.role, "cleave.policy": pool.policy}
    ) as span:
        worker = await pool.pick(tried, choose)
        span.set_attribute("cleave.worker", worker.address)
        return worker


@dataclass
class TokenInfo:
    """A generated token as text, with its logprob and the top alternatives."""

    token: str
    logprob: float
    top: list[tuple[str, float]]
    text_offset: int


@dataclass
class PromptTokenLogprob:
    """Score of one prompt token (from the worker that computed the prompt), with its top alternatives."""

    token_id: int
    token: str
    logprob: float
    rank: int
    top: list[tuple[int, str, float]]  # (token id, text, logprob), most likely first


@dataclass
class ChoiceDelta:
    """New output of one choice: text that is safe to show, and what produced it."""

    index: int
    text: str
    num_tokens: int
    logprobs: list[TokenInfo] | None = None
    finish_reason: str | None = None
    token_ids: list[int] = field(default_factory=list)  # the tokens of this delta
    num_cached_tokens: int = 0  # prompt tokens the serving worker found in its prefix cache
    prompt_logprobs: list[PromptTokenLogprob] | None = None  # prompt tokens 1.., on the first delta when asked


def sampling_to_proto(params: SamplingParams) -> worker_pb2.SamplingParams:
    """Wire form of the params; stop strings stay in the router, which owns the text."""
    msg = worker_pb2.SamplingParams(
        n=params.n,
        temperature=params.temperature,
        top_p=params.top_p,
        top_k=params.top_k,
        min_p=params.min_p,
        seed=params.seed,
        presence_penalty=params.presence_penalty,
        frequency_penalty=params.frequency_penalty,
        repetition_penalty=params.repetition_penalty,
        max_tokens=params.max_tokens,
        min_tokens=params.min_tokens,
        stop_token_ids=params.stop_token_ids,
        ignore_eos=params.ignore_eos,
        logprobs=params.logprobs,
        constraint=None if params.constraint is None else constraint_to_proto(params.constraint),
    )
    set_token_controls(msg, params)  # and prompt_logprobs
    return msg


def rpc_error(e: grpc.aio.AioRpcError, role: str, address: str) -> APIError:
    """Map a worker's gRPC status to the HTTP answer."""
    code = e.code()
    detail = e.details() or code.name
    if code == grpc.StatusCode.INVALID_ARGUMENT:
        return APIError(400, detail)
    # CANCELLED here came from the worker's side (our own cancellations raise CancelledError), and
    # ABORTED is a lease that ended before the prefill's reply: both are worth a retry.
    retryable = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.DEADLINE_EXCEEDED,
                 grpc.StatusCode.CANCELLED, grpc.StatusCode.ABORTED)  # fmt: skip
    if code in retryable:
        return APIError(503, f"{role} worker {address}: {code.name}: {detail}", "service_unavailable")
    return APIError(500, f"{role} worker {address} failed: {code.name}: {detail}", "server_error")


async def _prefill(
    ctx: CallContext, spec: ChoiceSpec, route: Route | None = None
) -> tuple[WorkerClient, worker_pb2.PrefillResponse] | None:
    """First token and KV handle from a prefill worker; None means: run aggregated instead."""
    pool, tried = ctx.pools.prefill, set[str]()
    choose = ctx.kv_router.chooser(route.blocks) if ctx.kv_router and route else None
    params = spec.params
    if params.n > 1:
        # A fork prefills once; its samples all draw their first token on the decode worker, so the
        # prefill's own token is dropped and must not end the request (it holds the lease).
        params = dataclasses.replace(params, n=1, ignore_eos=True, stop_token_ids=[], min_tokens=0)
    request = worker_pb2.PrefillRequest(
        request_id=spec.request_id, prompt_token_ids=spec.prompt_ids, sampling=sampling_to_proto(params)
    )
    while True:
        try:
            worker = await _pick(ctx, pool, tried, choose)
        except NoWorkerAvailable as e:
            logger.info("prefill_fallback request_id=%s reason=%r", spec.request_id, str(e))
            return None
        if tried:  # an earlier prefill worker was unreachable
            ctx.metrics.retries.labels("prefill").inc()
        with worker.track(route.uncached_blocks(ctx, worker) if route else 0):
            try:
                return worker, await worker.stub.Prefill(request, metadata=ctx.metadata, timeout=ctx.rpc_timeout_s)
            except asyncio.CancelledError:
                pool.abort(worker, spec.request_id, ctx.metadata)
                raise
            except grpc.aio.AioRpcError as e:
                if e.code() == grpc.StatusCode.UNAVAILABLE:
                    worker.mark_unreachable()
                    tried.add(worker.address)
                elif e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED:
                    logger.info("prefill_fallback request_id=%s reason=resource_exhausted", spec.request_id)
                    return None
                else:
                    raise rpc_error(e, "prefill", worker.address) from None


# Codes with which a decode stream that already produced tokens may move to another worker.
MIGRATABLE = frozenset(
    {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED, grpc.StatusCode.UNKNOWN, grpc.StatusCode.INTERNAL,
     grpc.StatusCode.ABORTED}
)  # fmt: skip


class WorkerUnreachable(Exception):
    """The decode worker refused the connection before producing anything: try another, same request."""


class StreamBroke(Exception):
    """A decode stream ended mid-generation for a reason another worker can recover from."""

    def __init__(self, error: APIError) -> None:
        super().__init__(error.message)
        self.error = error


async def _decode(
    ctx: CallContext, request: worker_pb2.GenerateRequest, route: Route | None = None, moves: Moves | None = None
) -> AsyncGenerator[worker_pb2.GenerateResponse, None]:
    """Stream ``Generate`` from a decode worker, moving on to another one if a worker is unreachable,
    and migrating the request (prompt + tokens so far) if its worker fails mid-stream.

    ``moves``: the history of a request that already moved (a sample of a fork that goes on alone).
    """
    pool = ctx.pools.decode
    moves = moves or Moves()
    preferred = route.decode_worker if route and route.decode_worker in pool.workers else None
    choose = ctx.kv_router.chooser(route.blocks) if ctx.kv_router and route else None
    progress = Progress.of(request)  # what the client has: tokens per sample, finished samples
    # Whether the next pick resumes a broken stream (a migration) or re-sends a call that never reached its
    # worker (a retry); each broken stream counts once under one outcome.
    moving = retrying = False
    while True:
        try:
            worker = preferred or await _pick(ctx, pool, moves.tried, choose)
        except NoWorkerAvailable as e:
            if moving:
                ctx.metrics.migrations.labels("no_worker").inc()
            raise moves.broken or APIError(503, str(e), "service_unavailable") from None
        if moving:
            ctx.metrics.migrations.labels("migrated").inc()
        elif retrying:
            ctx.metrics.retries.labels("decode").inc()
        preferred, moving, retrying = None, False, False
        try:
            async for response in _decode_on(ctx, pool, worker, request, route):
                progress.add(response)
                yield response
            return
        except WorkerUnreachable:
            moves.tried.add(worker.address)
            retrying = True
        except StreamBroke as broke:
            moves.tried.add(worker.address)
            # Beam search sends its hypotheses only when it ends: once one reached the client the others
            # died with the worker, so it ends with the error; with nothing sent yet it runs again, whole.
            beam_sent = request.sampling.use_beam_search and progress.num_responses > 0
            if moves.num_migrations >= ctx.migration_limit or beam_sent:
                ctx.metrics.migrations.labels("refused").inc()
                raise broke.error from None
            moves.num_migrations += 1
            moves.broken = broke.error
            logger.warning("stream_migrated request_id=%s from=%s generated=%d migration=%d reason=%r",
                           request.request_id, worker.address, sum(map(len, progress.tokens.values())),
                           moves.num_migrations, broke.error.message)  # fmt: skip
            if request.sampling.use_beam_search:
                moving = True  # the same request again
            elif request.sampling.n > 1:
                ctx.metrics.migrations.labels("migrated").inc()
                async with aclosing(_decode_samples(ctx, request, progress, moves)) as responses:
                    async for response in responses:
                        yield response
                return
            else:
                moving = True
                request = migrated_request(request, progress.tokens[0])


def _decode_samples(
    ctx: CallContext, fork: worker_pb2.GenerateRequest, progress: Progress, moves: Moves
) -> AsyncGenerator[worker_pb2.GenerateResponse, None]:
    """A broken fork goes on as one single-sample request per sample not yet finished (nor cut)."""
    ended = {i for i in progress.open_samples() if sample_id(fork.request_id, i) in ctx.ended_samples}
    streams = {
        index: _decode(ctx, sample_request(fork, index, progress.tokens[index]), None, moves.branch())
        for index in progress.open_samples()
        if index not in ended
    }
    return merge_samples(streams, lambda index: sample_id(fork.request_id, index) in ctx.ended_samples)


async def _decode_on(
    ctx: CallContext,
    pool: WorkerPool,
    worker: WorkerClient,
    request: worker_pb2.GenerateRequest,
    route: Route | None,
) -> AsyncGenerator[worker_pb2.GenerateResponse, None]:
    """One ``Generate`` stream on ``worker``; raises ``StreamBroke`` if it fails in a way another worker
    can recover from, ``WorkerUnreachable`` if the worker refused the call before it started."""
    call = worker.generate(request, ctx.metadata, ctx.rpc_timeout_s)
    received = finished = unreachable = False
    num_open = max(1, request.sampling.n)  # a forked request ends when all its samples have
    with worker.track(route.uncached_blocks(ctx, worker) if route else 0):
        try:
            async for response in call:
                received = True
                if response.finish_reason == "abort":
                    raise StreamBroke(
                        APIError(503, f"decode worker {worker.address} aborted the request", "service_unavailable")
                    )
                if response.finish_reason:
                    num_open -= 1
                finished = num_open == 0
                yield response
                if finished:
                    return
                if ctx.cut_samples:
                    _stop_cut_samples(ctx, pool, worker, request.request_id)
            raise StreamBroke(
                APIError(
                    500, f"decode worker {worker.address} ended the stream without a finish reason", "server_error"
                )
            )
        except grpc.aio.AioRpcError as e:
            if e.code() == grpc.StatusCode.UNAVAILABLE and not received:
                worker.mark_unreachable()
                unreachable = True
                raise WorkerUnreachable() from None
            if e.code() in MIGRATABLE and received:
                if e.code() == grpc.StatusCode.UNAVAILABLE:
                    worker.mark_unreachable()
                raise StreamBroke(rpc_error(e, "decode", worker.address)) from None
            raise rpc_error(e, "decode", worker.address) from None
        finally:
            if not finished and not unreachable:
                # Cancelling the stream lets the worker notice; Abort frees its blocks at once.
                call.cancel()
                pool.abort(worker, request.request_id, ctx.metadata)


async def plan_route(ctx: CallContext, spec: ChoiceSpec) -> Route | None:
    """kv_aware: hash the prompt and choose the decode worker first (its cache decides disaggregation)."""
    kv = ctx.kv_router
    if kv is None:
        return None
    blocks = kv.prompt_blocks(spec.prompt_ids)
    if blocks is None:
        return None
    try:
        decode_worker = await ctx.pools.decode.pick(None, kv.chooser(blocks))
    except NoWorkerAvailable as e:
        raise APIError(503, str(e), "service_unavailable") from None
    return Route(blocks, decode_worker, kv.overlap(decode_worker, blocks))


def _stop_cut_samples(ctx: CallContext, pool: WorkerPool, worker: WorkerClient, request_id: str) -> None:
    """Ask ``worker`` to end the samples of fork ``request_id`` that the router cut at a stop string."""
    for cut_id in [s for s in ctx.cut_samples if s == request_id or s.startswith(f"{request_id}/")]:
        ctx.cut_samples.discard(cut_id)
        pool.abort(worker, cut_id, ctx.metadata, sample_only=True)


async def worker_tokens(ctx: CallContext, spec: ChoiceSpec) -> AsyncGenerator[worker_pb2.GenerateResponse, None]:
    """All token batches of one choice, from whichever path serves it; the last one has a finish reason."""
    request = worker_pb2.GenerateRequest(
        request_id=spec.request_id, prompt_token_ids=spec.prompt_ids, sampling=sampling_to_proto(spec.params)
    )
    route = await plan_route(ctx, spec)
    fork = spec.params.n > 1
    disaggregate = (
        not spec.params.use_beam_search  # beam search runs whole on the decode worker
        and not (fork and spec.params.prompt_logprobs is not None)  # a fork's prompt is scored where it forks
        and bool(ctx.pools.prefill)
        and (spec.params.max_tokens or 0) > 1
        and len(spec.prompt_ids) >= ctx.disagg_min_prompt_tokens
    )
    if route is not None and ctx.kv_router is not None:
        # Disaggregate by what the chosen decode worker would still have to compute, not by prompt length.
        uncached = route.blocks.uncached_tokens(len(spec.prompt_ids), route.decode_overlap)
        disaggregate = disaggregate and uncached >= ctx.kv_router.min_uncached_tokens
    prefilled = await _prefill(ctx, spec, route) if disaggregate else None
    ctx.metrics.routed.labels("disaggregated" if prefilled else "aggregated").inc()
    if prefilled is None:
        async with aclosing(_decode(ctx, request, route)) as responses:
            async for response in responses:
                yield response
        return
    prefill_worker, first = prefilled
    if fork and not first.HasField("kv_handle"):
        # The prefill's one sample ended at once and its blocks are gone: the fork runs aggregated.
        async with aclosing(_decode(ctx, request, route)) as responses:
            async for response in responses:
                yield response
        return
    finished = bool(first.finish_reason) or not first.HasField("kv_handle")
    try:
        held = None  # the first token, until the decode worker announces the request
        if not fork:  # a fork's first tokens come from the decode worker, one per sample
            held = worker_pb2.GenerateResponse(
                tokens=[first.first_token],
                finish_reason=first.finish_reason,
                num_prompt_tokens=first.num_prompt_tokens,
                num_cached_tokens=first.num_cached_tokens,
                prompt_logprobs=first.prompt_logprobs,
            )
            if finished or not ctx.first_token_at_decode:
                yield held
                held = None
            if finished:
                return
        request.sampling.ClearField("prompt_logprobs")  # the prefill worker scored the prompt
        request.first_token.CopyFrom(first.first_token)
        request.kv_handle.CopyFrom(first.kv_handle)
        request.announce_admission = held is not None
        async with aclosing(_decode(ctx, request, route)) as responses:
            async for response in responses:
                if held is not None:
                    yield held
                    held = None
                    if not response.tokens and not response.finish_reason:
                        continue  # the announcement
                finished = bool(response.finish_reason)
                yield response
    finally:
        if not finished:
            # The decode worker may never have pulled the blocks; releasing twice is harmless.
            ctx.pools.prefill.release_kv(prefill_worker, spec.request_id, ctx.metadata)


@dataclass
class ChoiceDecoder:
    """Token batches of one choice → text deltas, with stop strings cut and held back."""

    tokenizer: Tokenizer
    spec: ChoiceSpec
    eos_token_ids: frozenset[int]
    detokenizer: IncrementalDetokenizer = field(init=False)
    text: str = ""
    num_emitted_chars: int = 0
    num_tokens: int = 0
    finish_reason: str | None = None
    prompt_scored: bool = False

    def __post_init__(self) -> None:
        params = self.spec.params
        self.detokenizer = IncrementalDetokenizer(self.tokenizer, self.spec.prompt_ids, params.skip_special_tokens)
        self.stop = list(params.stop)
        stop_ids = set(params.stop_token_ids) | (set() if params.ignore_eos else set(self.eos_token_ids))
        self.stop_token_ids = frozenset(stop_ids)

    def add(self, response: worker_pb2.GenerateResponse) -> ChoiceDelta:
        assert self.finish_reason is None, "tokens after the choice finished"
        params, tokens = self.spec.params, response.tokens
        logprobs: list[TokenInfo] | None = [] if params.logprobs is not None else None
        num_new = 0
        token_ids: list[int] = []
        for i, token in enumerate(tokens):
            num_new += 1
            token_ids.append(token.token_id)
            self.num_tokens += 1
            if logprobs is not None:
                logprobs.append(self._token_info(token))
            last = i == len(tokens) - 1
            # EOS / stop token ids end the text without showing the token itself.
            if not (last and response.finish_reason == "stop" and token.token_id in self.stop_token_ids):
                searched = len(self.text)
                self.text += self.detokenizer.add(token.token_id)
                if self._cut_at_stop(searched):
                    break
            if not last and params.max_tokens is not None and self.num_tokens >= params.max_tokens:
                self.finish_reason = "length"
                break
        if self.finish_reason is None:
            if response.finish_reason:
                self.finish_reason = response.finish_reason
            elif params.max_tokens is not None and self.num_tokens >= params.max_tokens:
                self.finish_reason = "length"
        if self.finish_reason is not None and self.finish_reason != "stop_string":
            searched = len(self.text)
            self.text += self.detokenizer.flush()
            self._cut_at_stop(searched)
        end = len(self.text)
        if self.finish_reason is None:
            end -= holdback_len(self.text, self.stop)
        delta_text = self.text[self.num_emitted_chars : end]
        self.num_emitted_chars = max(self.num_emitted_chars, end)
        if self.finish_reason == "stop_string":
            self.finish_reason = "stop"
        delta = ChoiceDelta(
            self.spec.index, delta_text, num_new, logprobs, self.finish_reason, token_ids, response.num_cached_tokens
        )
        if self.spec.params.prompt_logprobs is not None and not self.prompt_scored:
            self.prompt_scored = True
            delta.prompt_logprobs = [self._prompt_info(t) for t in response.prompt_logprobs]
        return delta

    def _as_text(self, token_id: int) -> str:
        """A token as logprob entries show it: its text, or ``token_id:N`` with return_tokens_as_token_ids."""
        if self.spec.tokens_as_ids:
            return f"token_id:{token_id}"
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    def _prompt_info(self, token: worker_pb2.TokenOutput) -> PromptTokenLogprob:
        top = [(t.token_id, self._as_text(t.token_id), t.logprob) for t in token.top_logprobs]
        return PromptTokenLogprob(token.token_id, self._as_text(token.token_id), token.logprob, token.rank, top)

    def _cut_at_stop(self, searched: int) -> bool:
        if not self.stop:
            return False
        index = find_stop(self.text, self.stop, searched)
        if index is None:
            return False
        self.text = self.text[:index]
        self.finish_reason = "stop_string"
        return True

    def _token_info(self, token: worker_pb2.TokenOutput) -> TokenInfo:
        top = [(self._as_text(t.token_id), t.logprob) for t in token.top_logprobs]
        return TokenInfo(self._as_text(token.token_id), token.logprob, top, len(self.text))


def fork_children(spec: ChoiceSpec) -> list[ChoiceSpec]:
    """The choices of a worker request: itself, or for a fork (``params.n`` > 1) one per sample."""
    if spec.params.n == 1:
        return [spec]
    params = dataclasses.replace(spec.params, n=1)
    return [
        dataclasses.replace(spec, index=spec.index + i, request_id=f"{spec.request_id}/{i}" if i else spec.request_id,
                            params=choice_params(params, i))
        for i in range(spec.params.n)
    ]  # fmt: skip


class ChoiceTaskFailed(Exception):
    """A choice's task ended without handing over its result or its error (a bug): the request fails."""


async def _run_choice(
    ctx: CallContext, spec: ChoiceSpec, make_decoder: Callable[[ChoiceSpec], ChoiceDecoder], queue: asyncio.Queue
) -> None:
    """The choices of one worker request (several for a fork): their deltas go to ``queue``."""
    children = fork_children(spec)
    decoders = {child.index: make_decoder(child) for child in children}
    sample_ids = {child.index: child.request_id for child in children}
    async with aclosing(worker_tokens(ctx, spec)) as stream:
        async for response in stream:
            decoder = decoders.get(spec.index + response.sample_index)
            if decoder is None or decoder.finish_reason is not None:
                continue  # a sample already cut at a stop string
            delta = decoder.add(response)
            ctx.timer.on_tokens(delta.index, delta.num_tokens)
            queue.put_nowait(delta)
            if delta.finish_reason and not response.finish_reason and len(children) > 1:
                ctx.cut_samples.add(sample_ids[delta.index])  # a stop string: the worker can stop it now
                ctx.ended_samples.add(sample_ids[delta.index])
            if delta.finish_reason:
                ctx.metrics.finished_sequences.labels(delta.finish_reason).inc()
                if all(d.finish_reason is not None for d in decoders.values()):
                    return


async def run_choices(
    ctx: CallContext, specs: Sequence[ChoiceSpec], make_decoder: Callable[[ChoiceSpec], ChoiceDecoder]
) -> AsyncGenerator[ChoiceDelta, None]:
    """Run every choice as its own task; yield deltas as they come. Any choice's error ends them all:
    it is raised here, and closing this cancels the other tasks, which aborts their worker calls."""
    queue: asyncio.Queue = asyncio.Queue()

    async def run_one(spec: ChoiceSpec) -> None:
        try:
            await _run_choice(ctx, spec, make_decoder, queue)
        except Exception as e:  # handed to the consumer, which raises it
            queue.put_nowait(e)

    tasks = [asyncio.create_task(run_one(spec), name=spec.request_id) for spec in specs]
    for task in tasks:
        task.add_done_callback(queue.put_nowait)  # however a task ends, the consumer hears of it
    try:
        remaining = len(tasks)
        while remaining:
            item = await queue.get()
            if isinstance(item, asyncio.Task):
                remaining -= 1
                if item.cancelled() or item.exception() is not None:
                    failure = "was cancelled" if item.cancelled() else f"raised {item.exception()!r}"
                    raise ChoiceTaskFailed(f"the task of worker request {item.get_name()} {failure}")
            elif isinstance(item, Exception):
                raise item
            else:
                yield item
    finally:
        for task in tasks:
            task.cancel()
        pending = [task for task in tasks if not task.done()]
        if pending:
            # Their cleanup (cancel the streams, abort the worker requests) runs before the answer ends.
            await asyncio.wait(pending, timeout=CLEANUP_TIMEOUT_S)
