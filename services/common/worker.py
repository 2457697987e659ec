"""What both worker roles share: flags, the engine, metrics, health/load/abort RPCs, serving."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import sys
import uuid

import grpc
from prometheus_client import Counter, Gauge, start_http_server

from shared.cli import add_engine_args, engine_config_from_args, env_default
from shared.engine.async_engine import AsyncEngine
from shared.engine.sampling_params import InvalidRequestError
from shared.genproto.cleave.v1 import worker_pb2 as pb

logger = logging.getLogger("cleave.worker")


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
    parser.add_argument("--metrics-port", type=int, default=int(env_default("--metrics-port", -1)),
                        help="Prometheus /metrics port (0: pick one, -1: off)")  # fmt: skip
    parser.add_argument("--worker-id", default=env_default("--worker-id", None))
    parser.add_argument("--kv-transfer-backend", default=env_default("--kv-transfer-backend", "auto"),
                        choices=["auto", "nixl", "tcp"], help="KV block transfer backend")  # fmt: skip
    parser.add_argument("--log-level", default=env_default("--log-level", "INFO"))
    return parser


class WorkerMetrics:
    def __init__(self, role: str, worker_id: str) -> None:
        labels = {"role": role, "worker_id": worker_id}
        self.labels = labels
        names = list(labels)

        def gauge(name, doc):
            return Gauge(name, doc, names).labels(**labels)

        def counter(name, doc):
            return Counter(name, doc, names).labels(**labels)

        self.running = gauge("cleave_num_requests_running", "requests in the running batch")
        self.waiting = gauge("cleave_num_requests_waiting", "requests waiting to be scheduled")
        self.kv_usage = gauge("cleave_kv_cache_usage_perc", "fraction of KV blocks in use (0-1)")
        self.free_blocks = gauge("cleave_kv_cache_free_blocks", "free or evictable KV blocks")
        self.prefix_queries = counter("cleave_prefix_cache_queries", "blocks looked up in the prefix cache")
        self.prefix_hits = counter("cleave_prefix_cache_hits", "blocks found in the prefix cache")
        self.preemptions = counter("cleave_num_preemptions", "requests preempted by recompute")
        self.prompt_tokens = counter("cleave_prompt_tokens", "prompt tokens computed")
        self.generation_tokens = counter("cleave_generation_tokens", "tokens generated")
        self.kv_bytes = counter("cleave_kv_transfer_bytes", "KV bytes moved between workers")
        self.kv_seconds = counter("cleave_kv_transfer_seconds", "seconds spent pulling KV")
        self.kv_transfers = counter("cleave_kv_transfers", "KV pulls completed")
        self.kv_failures = counter("cleave_kv_transfer_failures", "KV pulls that failed")
        self.kv_recomputes = counter("cleave_kv_recomputes", "requests whose prefill was recomputed locally")
        self.lease_expired = counter("cleave_kv_lease_expired", "KV leases that expired before release")
        self.leased = gauge("cleave_kv_leased_requests", "requests whose blocks are held for a pull")
        self._last: dict[str, int] = {}

    def _advance(self, counter, key: str, total: int) -> None:
        delta = total - self._last.get(key, 0)
        if delta > 0:
            counter.inc(delta)
        self._last[key] = total

    def update(self, stats) -> None:
        self.running.set(stats.num_running)
        self.waiting.set(stats.num_waiting)
        self.kv_usage.set(stats.kv_cache_usage)
        self.free_blocks.set(stats.num_free_blocks)
        self._advance(self.prefix_queries, "q", stats.prefix_cache_queries)
        self._advance(self.prefix_hits, "h", stats.prefix_cache_hits)
        self._advance(self.preemptions, "p", stats.num_preemptions)
        self._advance(self.prompt_tokens, "pt", stats.num_prompt_tokens_computed)
        self._advance(self.generation_tokens, "gt", stats.num_generation_tokens)
        self._advance(self.lease_expired, "le", stats.num_leases_expired)
        self.leased.set(stats.num_leased_requests)


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
            core.runner.kv_cache, self.peer_info, backend=args.kv_transfer_backend, host=args.host
        )
        self.metrics = WorkerMetrics(self.role, self.worker_id)
        Gauge(
            "cleave_kv_transfer_backend_info", "KV transfer backend in use (value 1)", ["role", "worker_id", "backend"]
        ).labels(role=self.role, worker_id=self.worker_id, backend=self.connector.backend_name).set(1)
        self.address = ""  # this worker's gRPC address, known once the port is bound
        logger.info(
            "worker role=%s id=%s kv_transfer_backend=%s", self.role, self.worker_id, self.connector.backend_name
        )

    async def Health(self, request, context) -> pb.HealthResponse:
        if self.engine.error is not None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"engine loop stopped: {self.engine.error}")
        return pb.HealthResponse(status="ok", role=self.role, model=self.args.model, worker_id=self.worker_id,
                                 max_model_len=self.engine.core.max_model_len)  # fmt: skip

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
        found = await self.engine.run(lambda: self.engine.core.abort(request.request_id))
        return pb.AbortResponse(found=bool(found))

    def background_tasks(self) -> list[asyncio.Task]:
        return []

    async def invalid(self, context, e: InvalidRequestError) -> None:
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))

    async def metrics_loop(self) -> None:
        while True:
            stats = self.engine.core.stats()
            self.metrics.update(stats)
            await asyncio.sleep(1.0)


async def serve(worker: WorkerBase, add_servicer) -> None:
    args = worker.args
    server = grpc.aio.server(options=SERVER_OPTIONS)
    add_servicer(worker, server)
    port = server.add_insecure_port(f"{args.host}:{args.port}")
    if port == 0:
        raise SystemExit(f"cannot bind gRPC port {args.host}:{args.port}")
    await server.start()
    worker.address = getattr(args, "advertise_addr", None) or f"{args.host}:{port}"
    metrics_port = -1
    if args.metrics_port >= 0:
        metrics_server, _ = start_http_server(args.metrics_port, addr=args.host)
        metrics_port = metrics_server.server_port
    tasks = [asyncio.create_task(worker.metrics_loop())] + worker.background_tasks()
    # One machine-readable line: launchers and tests wait for it.
    print(f"CLEAVE_READY role={worker.role} grpc={args.host}:{port} metrics_port={metrics_port} "
          f"worker_id={worker.worker_id} kv_backend={worker.connector.backend_name}", flush=True)  # fmt: skip
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    logger.info("worker stopping role=%s id=%s", worker.role, worker.worker_id)
    for t in tasks:
        t.cancel()
    await server.stop(grace=2)
    worker.connector.close()
    worker.engine.shutdown()


def main(parser: argparse.ArgumentParser, worker_cls, add_servicer, argv: list[str] | None = None) -> int:
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s %(message)s")  # fmt: skip
    worker = worker_cls(args)
    asyncio.run(serve(worker, add_servicer))
    return 0
