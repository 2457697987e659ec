"""What both worker roles share: flags, the engine, metrics, health/load/abort RPCs, serving."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import socket
import uuid
from collections.abc import AsyncGenerator
from contextlib import aclosing
from dataclasses import replace
from typing import Any

import grpc
import torch
from opentelemetry.context import Context

from services.common import event_loop
from services.common.background import BackgroundTasks
from services.common.draining import Drain
from services.common.heap import freeze_startup_heap
from services.common.http_endpoints import start_metrics_server
from services.common.metrics import RequestTracker, WorkerMetrics
from shared import flags
from shared.cli import add_engine_args, engine_config_from_args, env_default
from shared.engine.async_engine import AsyncEngine, NewRequest
from shared.engine.cpu_threads import LEND_AFTER_S, YIELD_MAX_S, CoreShare
from shared.engine.engine_core import RequestOutputDelta
from shared.engine.request import Request
from shared.engine.sampling_params import InvalidRequestError, SamplingParams
from shared.genproto.cleave.v1 import worker_pb2 as pb
from shared.kernels import cpu_kernels
from shared.logs import LOG_FORMATS, configure_logging
from shared.tracing import Tracing

logger = logging.getLogger("cleave.worker")

# A prefill worker borrows the decode CPUs (--core-share) only for a lone prompt: with more queued, a burst
# is on, and its hand-offs need the decode CPUs as soon as its first prompt is done.
PREFILL_BORROW_MAX_REQUESTS = 1
# A lone prompt after a quiet moment of the prefill worker (not the next of a queue) borrows them as soon as
# the decode workers idle, not after LEND_AFTER_S: one request at a time, each sent as the previous one ended,
# found the decode worker idle for less than that, and every prompt ran on one core (a 256-token prompt
# 114 ms of prefill against 65 ms aggregated).
PREFILL_LEND_AFTER_REST_S = 0.0
# See --decode-yield. The decode worker yields only while the prefill side holds more requests than it runs
# (CoreShare.yield_after): measured against 0 in interleaved runs (README, "Performance"), ratio 4 cut the median
# TTFT of the burst of 64 by 34-37% and of vLLM's client (32 prompts of 256 at once) by 26-31%, at +2% to +4%
# tok/s under the burst, +11% to +24% under the client, and a p99 ITL of 45-72 ms (vLLM's: 256-324); ratio 2
# cut TTFT 10-30% less for a p99 ITL of 28-56 ms, ratio 6 a little more for 54-85 ms. Yielding whenever the
# prefill side had a queue (the rule before) cost the burst up to 8% of its tok/s: its long outputs decoded at a
# fraction of their speed until the last prompt was in.
DECODE_YIELD = 4.0


def build_parser(role: str) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=f"cleave {role}-worker",
        description=f"Cleave {role} worker: a gRPC server around the engine in its {role} role. "
        "Every flag can also be set with CLEAVE_<FLAG>.",
    )
    add_engine_args(parser)
    parser.add_argument("--host", default=env_default("--host", "127.0.0.1"))
    parser.add_argument(
        "--port", type=int, default=int(env_default("--port", 0)), help="gRPC port (0: pick a free one)"
    )
    parser.add_argument("--metrics-port", type=int, default=int(env_default("--metrics-port", 0)),
                        help="Prometheus /metrics HTTP port (default 0: pick a free one, announced at start)")  # fmt: skip
    parser.add_argument("--no-metrics", action="store_true", default=env_default("--no-metrics", "").lower() in ("1", "true"),
                        help="serve no /metrics endpoint")  # fmt: skip
    parser.add_argument("--otlp-traces-endpoint", default=env_default("--otlp-traces-endpoint", None),
                        help="OTLP/gRPC collector URL for OpenTelemetry traces, e.g. http://127.0.0.1:4317 "
                        "(default: off, nothing exported)")  # fmt: skip
    parser.add_argument("--worker-id", default=env_default("--worker-id", None))
    parser.add_argument("--kv-transfer-backend", default=env_default("--kv-transfer-backend", "auto"),
                        choices=["auto", "nixl", "tcp"], help="KV block transfer backend")  # fmt: skip
    parser.add_argument("--no-kv-local-reads", action="store_true",
                        default=env_default("--no-kv-local-reads", "").lower() in ("1", "true"),
                        help="move KV blocks through --kv-transfer-backend also between workers on one machine "
                        "(by default a worker reads a peer's blocks on the same machine straight from that "
                        "process's memory, with process_vm_readv)")  # fmt: skip
    parser.add_argument("--log-level", default=env_default("--log-level", "INFO"))
    parser.add_argument("--redis-url", default=env_default("--redis-url", None),
                        help="register this worker in Redis for discovery, e.g. redis://127.0.0.1:6379/0 "
                        "(default: none; the router then needs this worker's address as a flag)")  # fmt: skip
    parser.add_argument("--drain-timeout", type=float, default=30.0,
                        help="seconds a SIGTERM waits for in-flight requests before exiting (keep it below "
                        "the pod's termination grace period)")  # fmt: skip
    parser.add_argument("--log-format", default=env_default("--log-format", "text"), choices=LOG_FORMATS,
                        help="text (default) or json: one JSON object per log line")  # fmt: skip
    parser.add_argument("--io-cpus", type=flags.parse_cpu_list, default=env_default("--io-cpus", None),
                        help="CPUs (a list like 0,2-3) for the worker's network threads: the gRPC server and the "
                             "token streams. The engine thread keeps the CPUs the worker started on, so a step "
                             "is not interrupted to send the previous step's tokens. Default: the same CPUs")  # fmt: skip
    parser.add_argument("--core-share", default=env_default("--core-share", None), metavar="SPEC",
                        help="set by cleave serve under its CPU split: FILE:lend:SLOT (a prefill worker marks "
                             "whether it computes) or FILE:borrow:SLOTS:CPUS (a decode worker's kernels also "
                             "run on CPUS while every lender is idle); default: none")  # fmt: skip
    parser.add_argument("--decode-yield", type=flags.parse_non_negative,
                        default=env_default("--decode-yield", str(DECODE_YIELD)),
                        metavar="RATIO",
                        help="with --core-share, while a prefill worker holds a queue (2 or more requests) of "
                             "more requests than the decode worker runs: the decode worker pauses RATIO times the "
                             f"length of each step after it (at most {YIELD_MAX_S * 1000:.0f} ms) and lends its "
                             "CPUs meanwhile, and a prefill worker borrows them, so a burst's prompts are not left "
                             "to the prefill CPUs alone: lower TTFT under a burst of prompts, at the cost of some "
                             "inter-token latency while it lasts. Give both sides the same value (cleave serve "
                             f"passes it to every worker). Default {DECODE_YIELD:g}; 0: the decode worker steps as "
                             "often as it can")  # fmt: skip
    return parser


# gRPC's C core cancels calls beyond 1,000 (soft) / 3,000 (hard) not yet picked up by the
# server's Python loop, which surfaced as CANCELLED under a wide fan-out. Requests queue in
# the engine instead, where the scheduler bounds them; the router caps choices per request.
MAX_PENDING_CALLS = 1 << 16
SERVER_OPTIONS = [
    ("grpc.max_receive_message_length", 64 << 20),
    ("grpc.server.max_pending_requests", MAX_PENDING_CALLS),
    ("grpc.server.max_pending_requests_hard_limit", MAX_PENDING_CALLS),
]


class WorkerBase:
    """Engine + KV connector + the RPCs every role answers."""

    role = ""
    serves_generate_many = False  # the GenerateMany RPC (services.common.call_mux)

    def __init__(self, args: argparse.Namespace) -> None:
        from services.kv_transfer.connector import create_connector, make_peer_info

        self.args = args
        self.worker_id = args.worker_id or f"{self.role}-{uuid.uuid4().hex[:8]}"
        self.engine = AsyncEngine(engine_config_from_args(args))
        core = self.engine.core
        self.peer_info = make_peer_info(
            core.runner.kv_cache, model_id=os.path.basename(os.path.abspath(args.model)), role=self.role
        )
        self.connector = create_connector(
            core.runner.kv_cache, self.peer_info, backend=args.kv_transfer_backend, host=args.host,
            local_reads=not args.no_kv_local_reads,
        )  # fmt: skip
        self.metrics = WorkerMetrics(self.role, self.worker_id, block_size=core.config.block_size,
                                     num_blocks=core.num_blocks, backend=self.connector.backend_name)  # fmt: skip
        core.on_step = self.metrics.observe_step
        if args.core_share and core.device.type == "cpu":
            core.core_share = CoreShare(
                args.core_share, own_threads=torch.get_num_threads(), lib=cpu_kernels.load(),
                borrow_max_requests=PREFILL_BORROW_MAX_REQUESTS if self.role == "prefill" else None,
                lend_after_rest_s=PREFILL_LEND_AFTER_REST_S if self.role == "prefill" else LEND_AFTER_S,
                yield_ratio=args.decode_yield if self.role == "decode" else 0.0,
                borrow_in_backlog=self.role == "prefill" and args.decode_yield > 0.0,
            )  # fmt: skip
            logger.info("core_share role=%s lent_cpus=%s", core.core_share.role,
                        flags.format_cpu_list(core.core_share.lent_cpus) or "-")  # fmt: skip
        self.tracing = Tracing(f"cleave-{self.role}-worker", args.otlp_traces_endpoint)
        self.kv_events: Any = None  # a KVEventPublisher when --redis-url is set
        self.drain = Drain()
        self.address = ""  # this worker's gRPC address, known once the port is bound
        logger.info(
            "worker role=%s id=%s kv_transfer_backend=%s", self.role, self.worker_id, self.connector.backend_name
        )

    def unhealthy_reason(self) -> str | None:
        """None when this worker takes work; otherwise why not (the health endpoints report it)."""
        if self.engine.error is not None:
            return f"engine loop stopped: {self.engine.error}"
        if self.drain.draining:
            return "draining: the worker is shutting down"
        return None

    async def admit(self, context) -> None:
        """Refuse a new call while draining: UNAVAILABLE sends the router to another worker."""
        if self.drain.draining:
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"worker {self.worker_id} is draining")

    async def Health(self, request, context) -> pb.HealthResponse:
        reason = self.unhealthy_reason()
        if reason is not None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, reason)
        return pb.HealthResponse(status="ok", role=self.role, model=self.args.model, worker_id=self.worker_id,
                                 max_model_len=self.engine.core.max_model_len,
                                 generate_many=self.serves_generate_many)  # fmt: skip

    @property
    def num_leased(self) -> int:
        """Finished prefills whose blocks wait for a pull (leases live in the engine)."""
        return self.engine.core.leases.num_leases

    async def LoadStats(self, request, context) -> pb.LoadStatsResponse:
        # Read without queueing behind a long engine step: plain counters, a snapshot is enough.
        stats = self.engine.core.stats()
        c = self.connector
        return pb.LoadStatsResponse(
            num_running=stats.num_running, num_waiting=stats.num_waiting, num_free_blocks=stats.num_free_blocks,
            num_total_blocks=stats.num_total_blocks, kv_cache_usage=stats.kv_cache_usage,
            num_leased_requests=stats.num_leased_requests, transfer_backend=c.backend_name,
            kv_transfer_bytes_total=c.bytes_total, kv_transfer_count=c.transfers_total,
            kv_transfer_failures=c.failures_total, kv_ownership_error=self.engine.ownership_error,
            num_held_blocks=stats.num_held_blocks,
        )  # fmt: skip

    async def Abort(self, request, context) -> pb.AbortResponse:
        if request.sample_only:
            found = await self.engine.run(lambda: self.engine.stop_sample(request.request_id))
        else:
            found = await self.engine.run(lambda: self.engine.core.abort(request.request_id))
        return pb.AbortResponse(found=bool(found))

    async def ListCachedBlocks(self, request, context) -> pb.ListCachedBlocksResponse:
        publisher = self.kv_events
        if publisher is not None:
            hashes, seq = await self.engine.run(publisher.snapshot)
        else:
            hashes, seq = await self.engine.run(self.engine.core.kv.pool.cached_hashes), 0
        return pb.ListCachedBlocksResponse(block_hashes=hashes, event_seq=seq,
                                           block_size=self.engine.core.config.block_size)  # fmt: skip

    def background_tasks(self) -> list[asyncio.Task]:
        return []

    def registry_entry(self, metrics_addr: str):
        """This worker as the Redis registry describes it (load read without waiting for a step)."""
        from services.common.registry import WorkerEntry

        stats = self.engine.core.stats()
        return WorkerEntry(
            worker_id=self.worker_id, role=self.role, grpc_addr=self.address, metrics_addr=metrics_addr,
            model=os.path.basename(os.path.abspath(self.args.model)), compat_hash=self.peer_info.compat_hash,
            block_size=self.engine.core.config.block_size, hash_seed="", num_blocks=stats.num_total_blocks,
            num_running=stats.num_running, num_waiting=stats.num_waiting, kv_cache_usage=stats.kv_cache_usage,
            kv_events=int(self.kv_events is not None),
        )  # fmt: skip

    async def compile_constraint(self, params: SamplingParams) -> None:
        """Compile the request's grammar in a thread, so a slow schema never stalls the engine loop.

        Raises InvalidRequestError when it does not compile; a no-op without a constraint or once cached.
        """
        if params.constraint is None:
            return
        self.metrics.structured_requests.inc()
        loop = asyncio.get_running_loop()
        seconds = await loop.run_in_executor(None, self.engine.core.compile_constraint, params.constraint)
        if seconds is not None:
            self.metrics.grammar_compiles.inc()
            self.metrics.grammar_compile_seconds.inc(seconds)

    async def invalid(self, context, e: InvalidRequestError) -> None:
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))

    async def stream(
        self, req: Request | NewRequest, admit=None, announce: bool = False
    ) -> AsyncGenerator[RequestOutputDelta, None]:
        """``engine.stream`` with the request's latency metrics observed on the way (the admission's
        announcement, ``announce``, is no token: not observed)."""
        trackers: list[RequestTracker] = []
        if isinstance(req, NewRequest):  # made on the engine thread: its tracker starts there

            def prepare(made: Request, inner=req.prepare) -> None:
                if inner is not None:
                    inner(made)
                trackers.append(self.metrics.tracker(made))

            req = replace(req, prepare=prepare)
        else:
            trackers.append(self.metrics.tracker(req))
        # aclosing: leaving early closes the engine stream at once, which aborts the request.
        async with aclosing(self.engine.stream(req, admit, announce)) as deltas:
            async for delta in deltas:
                if announce:
                    announce = False  # the first delta: the announcement
                else:
                    trackers[0].on_delta(delta)
                yield delta

    def parent_context(self, context) -> Context:
        """The caller's trace context from the RPC's metadata."""
        return self.tracing.extract(context.invocation_metadata())

    async def metrics_loop(self) -> None:
        while True:
            self.metrics.update(self.engine.core.stats(), self.num_leased, self.connector.local_bytes_total)
            await asyncio.sleep(1.0)


async def serve(worker: WorkerBase, add_servicer) -> None:
    args = worker.args
    if args.io_cpus:
        # This thread only (and the gRPC threads it starts next); the engine thread, started already, stays.
        os.sched_setaffinity(0, args.io_cpus)
        logger.info("network_threads cpus=%s engine_cpus=%s", flags.format_cpu_list(args.io_cpus),
                    flags.format_cpu_list(os.sched_getaffinity(worker.engine.thread_id)))  # fmt: skip
    server = grpc.aio.server(options=SERVER_OPTIONS)
    add_servicer(worker, server)
    port = server.add_insecure_port(f"{args.host}:{args.port}")
    if port == 0:
        raise SystemExit(f"cannot bind gRPC port {args.host}:{args.port}")
    await server.start()
    # A wildcard bind is not an address peers can dial: advertise the host name instead.
    reachable_host = socket.gethostname() if args.host in ("", "0.0.0.0", "::") else args.host
    worker.address = getattr(args, "advertise_addr", None) or f"{reachable_host}:{port}"
    metrics_port = -1  # -1 in the ready line: no /metrics
    if not args.no_metrics:
        metrics_server = start_metrics_server(args.host, args.metrics_port, worker.unhealthy_reason,
                                              worker.metrics.registry)  # fmt: skip
        metrics_port = metrics_server.server_port
        logger.info("metrics role=%s id=%s url=http://%s:%d/metrics", worker.role, worker.worker_id, args.host,
                    metrics_port)  # fmt: skip
    # Long-running loops: held, and a loop that dies says so in the log at once.
    tasks = BackgroundTasks()
    tasks.spawn(worker.metrics_loop(), "metrics_loop")
    for task in worker.background_tasks():
        tasks.adopt(task)
    registrar = None
    if args.redis_url:
        from services.common.registry import WorkerRegistrar

        # Scrapers dial the host the gRPC address advertises (a wildcard bind is no address).
        metrics_addr = f"{worker.address.rsplit(':', 1)[0]}:{metrics_port}" if metrics_port >= 0 else ""
        registrar = WorkerRegistrar(args.redis_url, lambda: worker.registry_entry(metrics_addr))
        heartbeat = tasks.spawn(registrar.run(), "registry_heartbeat")

        async def leave_registry() -> None:  # at once when draining starts: no new work is routed here
            heartbeat.cancel()
            await asyncio.gather(heartbeat, return_exceptions=True)
            await registrar.deregister()  # type: ignore[union-attr]

        worker.drain.on_drain(leave_registry)
        if worker.engine.core.config.enable_prefix_caching:
            from services.common.kv_events import KVEventPublisher

            worker.kv_events = KVEventPublisher(args.redis_url, worker.engine, worker.worker_id)
            tasks.spawn(worker.kv_events.run(), "kv_events")
    # One machine-readable line: launchers and tests wait for it.
    print(f"CLEAVE_READY role={worker.role} grpc={args.host}:{port} metrics_port={metrics_port} "
          f"worker_id={worker.worker_id} kv_backend={worker.connector.backend_name}", flush=True)  # fmt: skip
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()

    def on_signal() -> None:
        if stop.is_set():
            worker.drain.force()  # a second signal: stop waiting for in-flight requests
        stop.set()

    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, on_signal)
    await stop.wait()
    logger.info("worker draining role=%s id=%s", worker.role, worker.worker_id)
    # Hooks registered with worker.drain.on_drain (leaving the worker registry) run first.
    await worker.drain.drain(args.drain_timeout, busy=lambda: worker.num_leased)
    logger.info("worker stopping role=%s id=%s", worker.role, worker.worker_id)
    await tasks.close()
    if worker.kv_events is not None:
        await worker.kv_events.close()
    await server.stop(grace=2)
    worker.connector.close()
    worker.engine.shutdown()
    worker.tracing.shutdown()


def main(parser: argparse.ArgumentParser, worker_cls, add_servicer, argv: list[str] | None = None) -> int:
    args = flags.parse_args(parser, argv)
    configure_logging(args.log_level, args.log_format)
    try:
        loop = event_loop.loop_name()
    except ValueError as e:
        parser.error(str(e))
    worker = worker_cls(args)
    freeze_startup_heap()  # the model and its modules are never walked by a collection again
    event_loop.run(serve(worker, add_servicer), loop)
    return 0
