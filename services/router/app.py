"""FastAPI application of the router: routes, error shape, streaming glue.

Routes are thin: validate and tokenize with ``serving.prepare_*``, run the
choices with ``generation.run_choices``, shape the output with
``serving.*Format``. Every error leaves as ``{"error": {...}}`` with the status
of its cause; FastAPI's default 422 never does.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Mapping
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import anyio
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from opentelemetry import trace
from opentelemetry.trace import Span
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.datastructures import Headers
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Receive, Scope, Send

from services.router.body_limit import BodySizeLimit
from services.router.embeddings import install_embeddings
from services.router.extra_routes import install_extra_routes
from services.router.generation import CallContext, ChoiceDecoder, ChoiceDelta, ChoiceSpec, run_choices
from services.router.limits import api_key_error, overload_error, retry_after_headers, with_deadline
from services.router.metrics import RequestTimer, RouterMetrics
from services.router.openapi import install_openapi
from services.router.protocol import APIError, ChatCompletionRequest, CompletionRequest, ModelCard, ModelList
from services.router.serving import (
    SSE_DONE,
    ChatFormat,
    ChoiceResult,
    CompletionFormat,
    ModelInfo,
    Prepared,
    prepare_chat,
    prepare_completion,
    sse,
    usage,
)
from services.router.settings import RouterSettings
from services.router.spans import end_request_span, start_request_span
from services.router.state_metrics import RouterStateCollector
from services.router.workers import WorkerPools
from shared.models.config import ModelConfig, load_model_config
from shared.tokenizer import Tokenizer
from shared.tracing import Tracing

logger = logging.getLogger("cleave.router")

# nginx's code for "client closed the request", used in logs and metrics only.
CLIENT_CLOSED = 499

Format = CompletionFormat | ChatFormat


@dataclass
class RouterState:
    settings: RouterSettings
    tokenizer: Tokenizer
    model_config: ModelConfig
    metrics: RouterMetrics
    tracing: Tracing
    pools: WorkerPools | None = None
    watcher: Any = None  # the RegistryWatcher when --redis-url is set
    kv_router: Any = None  # the KVRouter under --routing-policy kv_aware
    kv_reader: Any = None  # the KVEventReader feeding its index
    in_flight: int = 0  # generation requests being answered (GET /load)

    def model_info(self) -> ModelInfo:
        """Context length: the configured one, lowered to the smallest any healthy worker reports."""
        max_model_len = self.settings.max_model_len or self.model_config.max_position_embeddings
        reported = self.pools.smallest_max_model_len() if self.pools else 0
        eos = set(self.model_config.eos_token_ids)
        if self.tokenizer.eos_token_id is not None:
            eos.add(self.tokenizer.eos_token_id)
        return ModelInfo(
            name=self.settings.model_name,
            max_model_len=min(max_model_len, reported) if reported else max_model_len,
            vocab_size=self.model_config.vocab_size,
            eos_token_ids=frozenset(eos),
            tool_call_parser=self.settings.tool_call_parser,
        )


def start_kv_routing(state: RouterState) -> tuple[Any, asyncio.Task | None]:
    """kv_aware: the KV index, the reader of the workers' event streams, and the router that uses them."""
    settings = state.settings
    if settings.routing_policy != "kv_aware" or state.watcher is None or not settings.redis_url:
        return None, None
    from services.router.kv_events import KVEventReader
    from services.router.kv_index import KVIndex
    from services.router.kv_routing import KVRouter

    index = KVIndex(settings.kv_index_max_entries)
    reader = KVEventReader(settings.redis_url, state.watcher, index)
    state.kv_reader = reader
    state.kv_router = KVRouter(index, state.watcher, settings.kv_overlap_weight, settings.router_temperature,
                               settings.disagg_min_uncached_tokens)  # fmt: skip
    return reader, asyncio.create_task(reader.run())


def log_request(**fields: object) -> None:
    logger.info("request " + " ".join(f"{k}={v}" for k, v in fields.items()))


class RequestRun:
    """One generation request in flight: collects choices, then records metrics and the log line."""

    def __init__(self, state: RouterState, endpoint: str, prep: Prepared, span: Span) -> None:
        self.state, self.endpoint, self.prep, self.span = state, endpoint, prep, span
        self.timer = RequestTimer(state.metrics)
        self.results = {spec.index: ChoiceResult(spec.index) for spec in prep.specs}
        self.finished = False
        state.metrics.running.inc()
        state.in_flight += 1

    def add(self, delta: ChoiceDelta) -> None:
        self.results[delta.index].add(delta)

    def ordered_results(self) -> list[ChoiceResult]:
        return [self.results[i] for i in sorted(self.results)]

    def finish(self, status: int) -> None:
        if self.finished:
            return
        self.finished = True
        metrics, results = self.state.metrics, self.ordered_results()
        metrics.running.dec()
        self.state.in_flight -= 1
        metrics.requests.labels(self.endpoint, str(status)).inc()
        num_generated = sum(r.num_tokens for r in results)
        latency = self.timer.finish(self.prep.num_prompt_tokens, num_generated)
        ttft = self.timer.ttft_s
        log_request(
            request_id=self.prep.request_id,
            method="POST",
            endpoint=self.endpoint,
            model=self.state.settings.model_name,
            status=status,
            stream=self.prep.stream,
            n=len(results),
            prompt_tokens=self.prep.num_prompt_tokens,
            completion_tokens=num_generated,
            finish=",".join(str(r.finish_reason) for r in results),
            ttft_ms="-" if ttft is None else f"{ttft * 1000:.1f}",
            latency_ms=f"{latency * 1000:.1f}",
        )
        end_request_span(self.span, status, self.prep.num_prompt_tokens, num_generated,
                         [str(r.finish_reason) for r in results], ttft)  # fmt: skip


class ClientGone(Exception):
    """The HTTP client disconnected before the answer was ready."""


async def _wait_for_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def until_disconnect(request: Request, work: Awaitable) -> object:
    """Await ``work``, cancelling it (and so the worker calls) if the client goes away first."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_wait_for_disconnect(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if task.done():
            return task.result()
        raise ClientGone()
    finally:
        watcher.cancel()
        task.cancel()
        # Let the cancellation run its cleanup (worker aborts) before the caller touches the stream again.
        await asyncio.gather(task, watcher, return_exceptions=True)


async def _sse_body(
    run: RequestRun, fmt: Format, first: ChoiceDelta | None, events: AsyncGenerator
) -> AsyncIterator[str]:
    status, done = 200, False
    try:
        for chunk in fmt.opening_chunks():
            yield sse(chunk)
        pending = [first] if first is not None else []
        while True:
            delta: ChoiceDelta | None = pending.pop() if pending else await anext(events, None)
            if delta is None:
                break
            run.add(delta)
            delta_chunk = fmt.delta_chunk(delta)
            for piece in delta_chunk if isinstance(delta_chunk, list) else [delta_chunk]:
                if piece is not None:
                    yield sse(piece)
        if run.prep.include_usage:
            yield sse(fmt.usage_chunk(usage(run.prep, run.ordered_results())))
        done = True
        yield SSE_DONE
    except APIError as e:
        status, done = e.status_code, True
        logger.warning("stream_failed request_id=%s status=%d error=%r", run.prep.request_id, status, e.message)
        yield sse(e.body())
        yield SSE_DONE
    except Exception:
        status, done = 500, True
        logger.exception("stream_failed request_id=%s", run.prep.request_id)
        yield sse(APIError(500, "internal error in the router; see its log", "server_error").body())
        yield SSE_DONE
    finally:
        await events.aclose()
        run.finish(status if done else CLIENT_CLOSED)


async def _collect(run: RequestRun, events: AsyncIterator) -> None:
    async for delta in events:
        run.add(delta)


def start_choices(state: RouterState, run: RequestRun) -> AsyncGenerator[ChoiceDelta, None]:
    """The deltas of every choice of ``run``; nothing reaches a worker before the first ``anext``."""
    assert state.pools is not None, "worker pools start with the app"
    ctx = CallContext(
        state.pools,
        (*state.tracing.inject(run.span), ("x-request-id", run.prep.request_id)),
        state.settings.rpc_timeout_s,
        state.settings.disagg_min_prompt_tokens,
        state.metrics,
        run.timer,
        state.kv_router,
        state.settings.migration_limit,
        state.tracing,
        trace.set_span_in_context(run.span),
        first_token_at_decode=state.settings.first_token_at == "decode",
    )
    eos = state.model_info().eos_token_ids

    def make_decoder(spec: ChoiceSpec) -> ChoiceDecoder:
        return ChoiceDecoder(state.tokenizer, spec, eos)

    return with_deadline(run_choices(ctx, run.prep.worker_requests, make_decoder), state.settings.request_timeout_s,
                         state.metrics)  # fmt: skip


async def serve_generation(
    state: RouterState,
    request: Request,
    prepare: Callable[[str], Prepared],
    make_format: Callable[[Prepared, str], Format],
    id_prefix: str,
) -> Response:
    """Shared body of both generation endpoints."""
    endpoint, request_id = request.url.path, f"{id_prefix}-{uuid.uuid4().hex}"
    headers = {"x-request-id": request_id}
    run: RequestRun | None = None
    events: AsyncGenerator | None = None
    span = start_request_span(state.tracing, request, id_prefix, state.settings.model_name, request_id)
    try:
        assert state.pools is not None
        overloaded = overload_error(state.pools, state.settings.max_queued_requests, state.metrics)
        if overloaded is not None:
            raise overloaded
        # Off the event loop: a long prompt's chat template and tokenization must not stall other requests.
        prep = await asyncio.to_thread(prepare, request_id)
        run = RequestRun(state, endpoint, prep, span)
        events = start_choices(state, run)
        fmt = make_format(prep, state.settings.model_name)
        if prep.stream:
            # Wait for the first token before answering, so that early failures keep their status.
            first = await until_disconnect(request, anext(events, None))
            body = _sse_body(run, fmt, first, events)  # type: ignore[arg-type]
            events = None  # the body owns it now
            return StreamingResponse(body, media_type="text/event-stream", headers=headers)
        await until_disconnect(request, _collect(run, events))
        results = run.ordered_results()
        run.finish(200)
        return JSONResponse(fmt.response(results, usage(prep, results)), headers=headers)
    except ClientGone:
        if run is not None:
            run.finish(CLIENT_CLOSED)
        return Response(status_code=CLIENT_CLOSED)
    except APIError as e:
        if run is not None:
            run.finish(e.status_code)
        else:
            state.metrics.requests.labels(endpoint, str(e.status_code)).inc()
            log_request(request_id=request_id, method="POST", endpoint=endpoint, status=e.status_code,
                        model=state.settings.model_name, error=repr(e.message))  # fmt: skip
            end_request_span(span, e.status_code, 0, 0, [], None)
        return JSONResponse(e.body(), status_code=e.status_code, headers={**headers, **retry_after_headers(e)})
    except Exception as e:
        logger.exception("request_failed request_id=%s", request_id)
        error = APIError(500, "internal error in the router; see its log", "server_error")
        span.record_exception(e)
        if run is not None:
            run.finish(500)
        else:
            end_request_span(span, 500, 0, 0, [], None)
        return JSONResponse(error.body(), status_code=500, headers=headers)
    finally:
        if events is not None:
            await events.aclose()


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    errors = exc.errors()
    parts, param = [], None
    for error in errors:
        loc = [str(x) for x in error.get("loc", ()) if x != "body"]
        if error.get("type") == "json_invalid":
            return f"request body is not valid JSON: {error.get('ctx', {}).get('error', error.get('msg'))}", None
        param = param or (loc[0] if loc else None)
        parts.append(f"{'.'.join(loc) or 'body'}: {error.get('msg')}")
    return "invalid request: " + "; ".join(parts), param


GENERATION_ID_PREFIXES = {"/v1/completions": "cmpl", "/v1/chat/completions": "chatcmpl"}


def _refused_request_span(request: Request, status: int) -> None:
    """A generation request refused before its route ran (body validation) still gets its span."""
    state = getattr(request.app.state, "router", None)
    prefix = GENERATION_ID_PREFIXES.get(request.url.path)
    if state is None or prefix is None:
        return
    request_id = f"{prefix}-{uuid.uuid4().hex}"
    span = start_request_span(state.tracing, request, prefix, state.settings.model_name, request_id)
    end_request_span(span, status, 0, 0, [], None)


def install_error_handlers(app: FastAPI, metrics: RouterMetrics) -> None:
    """Answer every error in the OpenAI shape, and count it."""

    def answer(request: Request, error: APIError, headers: Mapping[str, str] | None = None) -> JSONResponse:
        metrics.requests.labels(request.url.path, str(error.status_code)).inc()
        log_request(endpoint=request.url.path, status=error.status_code, error=repr(error.message))
        return JSONResponse(error.body(), status_code=error.status_code, headers=headers)

    @app.exception_handler(RequestValidationError)
    async def on_validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = _validation_message(exc)
        _refused_request_span(request, 400)
        return answer(request, APIError(400, message, "invalid_request_error", param))

    @app.exception_handler(APIError)
    async def on_api_error(request: Request, exc: APIError) -> JSONResponse:
        return answer(request, exc)

    @app.exception_handler(StarletteHTTPException)
    async def on_http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        err_type = "invalid_request_error" if exc.status_code < 500 else "server_error"
        # Keeps the headers that come with the status, e.g. ``Allow`` on a 405.
        return answer(request, APIError(exc.status_code, str(exc.detail), err_type), exc.headers)

    @app.exception_handler(Exception)
    async def on_unexpected(request: Request, exc: Exception) -> JSONResponse:
        logger.error("unhandled_error path=%s", request.url.path, exc_info=exc)
        return answer(request, APIError(500, "internal error in the router; see its log", "server_error"))


class APIKeyCheck:
    """``/v1/*`` answers 401 without ``Authorization: Bearer <api_key>``. Plain ASGI: a stream's chunks pass
    straight through (Starlette's ``BaseHTTPMiddleware`` relays each one through a task and a memory stream,
    which nearly doubled the router's CPU per streamed token)."""

    def __init__(self, app: ASGIApp, api_key: str, metrics: RouterMetrics) -> None:
        self.app, self.api_key, self.metrics = app, api_key, metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"].startswith("/v1/"):
            error = api_key_error(Headers(scope=scope).get("authorization"), self.api_key)
            if error is not None:
                self.metrics.requests.labels(scope["path"], "401").inc()
                log_request(endpoint=scope["path"], status=401, error=repr(error.message))
                response = JSONResponse(error.body(), status_code=401, headers={"www-authenticate": "Bearer"})
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


def load_model(settings: RouterSettings) -> tuple[Tokenizer, ModelConfig]:
    tokenizer = Tokenizer.from_dir(settings.model)
    _ = tokenizer.max_token_chars  # a walk over the vocabulary (16 ms for 49k tokens): at start, not in a request
    return tokenizer, load_model_config(settings.model)


def create_app(
    settings: RouterSettings,
    tokenizer: Tokenizer | None = None,
    model_config: ModelConfig | None = None,
    metrics: RouterMetrics | None = None,
) -> FastAPI:
    """The router app; the tokenizer and config load from ``settings.model`` unless given."""
    if tokenizer is None or model_config is None:
        loaded_tokenizer, loaded_config = load_model(settings)
        tokenizer, model_config = tokenizer or loaded_tokenizer, model_config or loaded_config
    tracing = Tracing("cleave-router", settings.otlp_traces_endpoint)
    state = RouterState(settings, tokenizer, model_config, metrics or RouterMetrics(), tracing)
    state.metrics.watch_state(RouterStateCollector(state))
    created = int(time.time())

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        # A streamed answer runs in an anyio task group; its backend is imported on first use, which cost
        # the first streamed request after a start (and every request queued behind it) about 0.15 s.
        async with anyio.create_task_group():
            pass
        state.pools = WorkerPools(settings.prefill_workers, settings.decode_workers, settings.routing_policy,
                                  state.metrics, per_call_streams=settings.worker_streams == "per-call")  # fmt: skip
        await state.pools.start(settings.health_interval_s)
        watcher, watch_task = None, None
        if settings.redis_url:
            from services.router.discovery import RegistryWatcher

            watcher = RegistryWatcher(settings.redis_url, state.pools)
            state.watcher = watcher
            watch_task = asyncio.create_task(watcher.run())
        kv_reader, kv_task = start_kv_routing(state)
        logger.info(
            "router_started model=%s prefill_workers=%d decode_workers=%d",
            settings.model_name,
            len(settings.prefill_workers),
            len(settings.decode_workers),
        )
        try:
            yield
        finally:
            if kv_task is not None and kv_reader is not None:
                kv_task.cancel()
                await asyncio.gather(kv_task, return_exceptions=True)
                await kv_reader.close()
            if watch_task is not None and watcher is not None:
                watch_task.cancel()
                await asyncio.gather(watch_task, return_exceptions=True)
                await watcher.close()
            await state.pools.close()
            state.tracing.shutdown()

    app = FastAPI(title="Cleave router", lifespan=lifespan)
    app.state.router = state
    install_error_handlers(app, state.metrics)
    if settings.api_key:
        app.add_middleware(APIKeyCheck, api_key=settings.api_key, metrics=state.metrics)
    install_extra_routes(app, state, created)
    install_embeddings(app, state)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        def prepare(request_id: str) -> Prepared:
            return prepare_completion(
                body, request_id, state.model_info(), state.tokenizer, settings.max_choices_per_request
            )

        return await serve_generation(state, request, prepare, CompletionFormat, "cmpl")

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        def prepare(request_id: str) -> Prepared:
            return prepare_chat(body, request_id, state.model_info(), state.tokenizer, settings.max_choices_per_request)

        return await serve_generation(state, request, prepare, ChatFormat, "chatcmpl")

    @app.get("/v1/models")
    async def models() -> dict:
        info = state.model_info()
        card = ModelCard(id=info.name, created=created, root=settings.model, max_model_len=info.max_model_len)
        return ModelList(data=[card]).model_dump()

    @app.get("/health")
    async def health() -> JSONResponse:
        assert state.pools is not None
        pools = {"prefill": state.pools.prefill, "decode": state.pools.decode}
        body = {
            role: [{"address": w.address, "healthy": w.healthy} for w in pool.workers] for role, pool in pools.items()
        }
        healthy = bool(state.pools.decode.healthy_workers())
        return JSONResponse({"status": "ok" if healthy else "unavailable", **body}, status_code=200 if healthy else 503)

    @app.get("/kv_index")
    async def kv_index() -> JSONResponse:
        """What the router's KV index holds per worker: block count and a digest of the hashes."""
        if state.kv_router is None:
            raise APIError(404, "no KV index: the router runs with --routing-policy kv_aware only", "not_found")
        return JSONResponse(state.kv_router.index.summary())

    @app.get("/metrics")
    async def metrics_endpoint() -> Response:
        return Response(state.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    install_openapi(app)

    def count_refused(path: str) -> None:
        state.metrics.requests.labels(path, "413").inc()
        log_request(endpoint=path, status=413, error="'body too large'")

    app.add_middleware(BodySizeLimit, limit=settings.max_request_body_bytes, on_refused=count_refused)
    return app
