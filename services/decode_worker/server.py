"""Decode worker: continues requests whose KV was prefilled elsewhere (pulled
into local blocks over the KV connector), or serves them whole (aggregated)."""

from __future__ import annotations

import argparse
import asyncio
import logging
import time
from concurrent.futures import Future
from contextlib import aclosing
from dataclasses import replace

import grpc
from opentelemetry import trace
from opentelemetry.trace import Span, SpanKind, Status, StatusCode

from services.common.background import BackgroundTasks
from services.common.call_mux import serve_calls
from services.common.convert import sampling_from_proto, token_to_proto
from services.common.worker import WorkerBase, build_parser
from services.common.worker import main as worker_main
from services.decode_worker.fork import resample_first_token
from services.kv_transfer.connector import KVTransferError
from services.kv_transfer.engine_transport import ConnectorTransport
from services.kv_transfer.handshake import PROTOCOL_VERSION, KVCompatibilityError
from shared.cli import env_default
from shared.engine.async_engine import NewRequest
from shared.engine.kv_connector import KVConnectorWorker, KVLoad, LoadResult, RemoteKV
from shared.engine.request import Request
from shared.engine.sampling_params import InvalidRequestError, SamplingParams
from shared.genproto.cleave.v1 import worker_pb2 as pb
from shared.genproto.cleave.v1 import worker_pb2_grpc as pb_grpc
from shared.tracing import mark_error

logger = logging.getLogger("cleave.decode")


def build_decode_parser() -> argparse.ArgumentParser:
    parser = build_parser("decode")
    parser.add_argument("--kv-pull-failure-policy", default=env_default("--kv-pull-failure-policy", "recompute"),
                        choices=["recompute", "fail"],
                        help="when a KV pull fails or its lease expired: recompute the prefill here, or fail")  # fmt: skip
    return parser


class PullFailed(Exception):
    pass


class DecodeWorker(WorkerBase):
    role = "decode"
    serves_generate_many = True

    def __init__(self, args: argparse.Namespace) -> None:
        super().__init__(args)
        self._peers: dict[str, str] = {}  # prefill gRPC address -> connector peer id (handshaken)
        self._replaced: set[str] = set()  # peer ids of prefill processes that another one replaced
        self._stubs: dict[str, pb_grpc.PrefillWorkerStub] = {}
        self.background = BackgroundTasks()  # KV releases: kept referenced, failures logged
        # Set when draining starts: GenerateMany streams end once their calls have, so that the
        # server stops without waiting out its grace period for the router's idle stream.
        self._streams_closing = asyncio.Event()

        async def close_streams() -> None:
            self._streams_closing.set()

        self.drain.on_drain(close_streams)
        self.kv_loader = KVConnectorWorker(ConnectorTransport(self.connector, self._release))

    def _stub(self, addr: str) -> pb_grpc.PrefillWorkerStub:
        """The prefill worker at ``addr`` (kept: building a stub registers every method, per request)."""
        stub = self._stubs.get(addr)
        if stub is None:
            stub = self._stubs[addr] = pb_grpc.PrefillWorkerStub(grpc.aio.insecure_channel(addr))
        return stub

    async def _peer(self, handle: pb.KVHandle, failed: str | None = None) -> str:
        """The connector peer id of the handle's prefill worker, handshaking when it is new, when it
        restarted (the handle names another ``kv_peer_id``) or when a pull from peer ``failed``."""
        addr = handle.prefill_worker_addr
        if handle.kv_peer_id in self._replaced:
            raise PullFailed(f"prefill worker {addr} restarted after the prefill; its KV is gone")
        cached = self._peers.get(addr)
        if cached is not None and cached != failed and handle.kv_peer_id in ("", cached):
            return cached
        loop = asyncio.get_running_loop()
        reply = await self._stub(addr).GetKVMetadata(
            pb.KVMetadataRequest(protocol_version=PROTOCOL_VERSION, compat_hash=self.peer_info.compat_hash),
            timeout=10,
        )
        peer = await loop.run_in_executor(None, self.connector.add_peer, reply.metadata)
        if cached is not None and cached != peer and self._peers.get(addr) == cached:
            self._replaced.add(cached)
            await loop.run_in_executor(None, self.connector.remove_peer, cached)
            logger.info("kv_rehandshake prefill_worker_addr=%s old_peer=%s new_peer=%s", addr, cached, peer)
        self._peers[addr] = peer
        if handle.kv_peer_id and peer != handle.kv_peer_id:
            # Another process answers on that address now: the handle's blocks died with the old one.
            raise PullFailed(f"prefill worker {addr} restarted after the prefill; its KV is gone")
        return peer

    async def _pull_once_more(self, handle: pb.KVHandle, attempt) -> LoadResult:
        """Pull; on a transfer failure handshake again (the prefill worker may have restarted) and retry once."""
        peer = await self._peer(handle)
        try:
            return await attempt(peer)
        except KVTransferError as e:
            logger.info("kv_pull_retry request_id=%s error=%s", handle.request_id, e)
            return await attempt(await self._peer(handle, failed=peer))

    async def Generate(self, request: pb.GenerateRequest, context):
        await self.admit(context)
        span = self.tracing.start("decode", self.parent_context(context), SpanKind.SERVER,
                                  attributes={"cleave.request_id": request.request_id})  # fmt: skip
        num_tokens = 0
        try:
            with self.drain.track():
                async with aclosing(self._generate(request, context, span)) as messages:
                    async for msg in messages:
                        num_tokens += len(msg.tokens)
                        yield msg
        except BaseException as e:
            if not isinstance(e, (GeneratorExit, asyncio.CancelledError)):
                mark_error(span, e, f"decode failed: {e}")
            raise
        finally:
            span.set_attribute("gen_ai.usage.output_tokens", num_tokens)
            span.end()

    async def GenerateMany(self, request_iterator, context):
        """Many Generate calls on one stream, their tokens sent together (services.common.call_mux)."""
        async with aclosing(serve_calls(self.Generate, request_iterator, self._streams_closing)) as messages:
            async for message in messages:
                yield message

    async def _generate(self, request: pb.GenerateRequest, context, span: Span):
        core = self.engine.core
        # A plain request (no KV to pull, nothing generated elsewhere) is made and queued in one engine
        # command; the others are made first, then resumed or given their pulled blocks.
        plain = not request.generated_token_ids and not request.HasField("kv_handle")
        # A KV pull makes its request in the command that allocates the blocks (one wait for a step
        # boundary instead of two before the pull can start).
        pull = request.HasField("kv_handle") and not request.generated_token_ids
        made: list[Request] = []
        req: Request | None = None
        try:
            params = sampling_from_proto(request.sampling)
            await self.compile_constraint(params)
            if not plain and not pull:
                req = await self.engine.run(
                    lambda: core.make_request(request.request_id, list(request.prompt_token_ids), params)
                )
            if request.generated_token_ids:
                if request.HasField("kv_handle"):
                    raise InvalidRequestError("generated_token_ids and kv_handle exclude each other")
                resumed = req
                assert resumed is not None
                await self.engine.run(lambda: core.resume(resumed, list(request.generated_token_ids)))
        except InvalidRequestError as e:
            await self.invalid(context, e)
        admit, transfer = None, {}
        if request.HasField("kv_handle") and params.use_beam_search:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "beam search runs whole here; send no KV handle")
        if request.HasField("kv_handle"):
            with self.tracing.span("kv_transfer", trace.set_span_in_context(span)) as kv_span:
                req, admit, transfer, local = await self._remote_prefill(request, params, context)
                self._describe_transfer(kv_span, request.kv_handle, transfer, local)
            if params.n > 1:
                matcher = None if params.constraint is None else core.grammar_backend().matcher(params.constraint)
                admit = resample_first_token(req, admit, core.config.block_size, matcher)
        # Announced once its pulled KV is in place: a request that computes its prompt here (no handle, or a
        # failed pull) is a prefill away from its next token, which it then sends instead.
        announce = request.announce_admission and admit is not None
        first = True
        source = req if req is not None else NewRequest(request.request_id, list(request.prompt_token_ids), params,
                                                        made.append)  # fmt: skip
        try:
            async with aclosing(self.stream(source, admit, announce)) as deltas:
                async for delta in deltas:
                    msg = pb.GenerateResponse(
                        tokens=[token_to_proto(s) for s in delta.new_samples], finish_reason=delta.finish_reason or "",
                        num_prompt_tokens=delta.num_prompt_tokens, num_cached_tokens=delta.num_cached_tokens,
                        prompt_logprobs=[token_to_proto(s) for s in delta.prompt_logprobs or []],
                        embedding=delta.embedding or [], sample_index=delta.sample_index,
                    )  # fmt: skip
                    if first:
                        first = False
                        for key, value in transfer.items():
                            setattr(msg, key, value)
                    yield msg
        except InvalidRequestError as e:  # a plain request that make_request refused
            await self.invalid(context, e)
        finally:
            made_req = req if req is not None else (made[0] if made else None)
            if made_req is not None:
                span.set_attribute("cleave.preemptions", made_req.num_preemptions)
            if admit is not None and made_req is not None:
                # Pulled blocks of a request cancelled before it joined the batch belong to no one else.
                pulled = made_req
                self.engine.submit(lambda: core.kv_connector.free_unjoined(pulled), "free_unjoined")

    def _describe_transfer(self, span: Span, handle: pb.KVHandle, transfer: dict, local: bool) -> None:
        if not span.is_recording():
            return
        span.set_attributes({"cleave.kv.local_read": local,
            "cleave.kv.bytes": transfer.get("kv_transfer_bytes", 0), "cleave.kv.blocks": len(handle.block_ids),
            "cleave.kv.backend": self.connector.backend_name, "cleave.kv.recomputed": transfer.get("kv_recomputed", False),
            "cleave.kv.duration_seconds": transfer.get("kv_transfer_seconds", 0.0),
        })  # fmt: skip
        if transfer.get("kv_recomputed"):
            span.set_status(Status(StatusCode.ERROR, "KV pull failed; prefill recomputed locally"))

    async def _remote_prefill(self, request: pb.GenerateRequest, params: SamplingParams, context):
        """Make the request and pull the prompt's KV the local prefix cache lacks; returns the request, how to
        admit it, the figures and whether the blocks were read from the prefill worker's memory (host_memory)."""
        handle = request.kv_handle
        core = self.engine.core
        connector = core.kv_connector
        made: list[Request] = []

        def make() -> Request:
            made_req = core.make_request(request.request_id, list(request.prompt_token_ids), params)
            made_req.append_output_token(request.first_token.token_id)
            made.append(made_req)
            return made_req

        def free() -> None:  # on the engine thread, after any allocation (commands run in order)
            if made:
                connector.free_unjoined(made[0])

        if handle.protocol_version != PROTOCOL_VERSION or handle.compat_hash != self.peer_info.compat_hash:
            await context.abort(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"KV handle from worker {handle.worker_id} is incompatible: protocol {handle.protocol_version} hash "
                f"{handle.compat_hash}, this decode worker expects protocol {PROTOCOL_VERSION} hash "
                f"{self.peer_info.compat_hash}. Start all workers with the same model, --dtype and --block-size.",
            )
        start = time.perf_counter()
        remote = remote_kv(handle, peer_id="")  # the peer id is known after the handshake
        load: KVLoad | None = None
        pending: Future[LoadResult] | None = None
        last_peer = ""  # the peer of the last pull attempt
        try:
            if time.time() > handle.lease_deadline_unix:
                raise PullFailed("the KV lease expired before the pull")
            # Allocating touches no request of the step in flight: it runs during the forward, so the
            # pull overlaps that step and the request can join the next one.
            load = await self.engine.run_soon(lambda: connector.allocate(make(), remote))
            if load is None:
                raise PullFailed("no free KV blocks for the pull")
            planned = load

            async def attempt(peer: str) -> LoadResult:
                nonlocal pending, last_peer
                last_peer = peer
                pending = self.kv_loader.start_load(replace(planned, remote=replace(remote, peer_id=peer)))
                return await asyncio.shield(asyncio.wrap_future(pending))

            if load.num_blocks:  # a prompt cached here whole needs no handshake and no transfer
                result = await self._pull_once_more(handle, attempt)
            else:
                result = LoadResult(num_bytes=0, seconds=0.0, num_descriptors=0)
        except asyncio.CancelledError:
            # The caller went away. Free the blocks (commands run in order, so after any
            # allocation), but only once a running load can no longer write into them.
            def free_later(_=None) -> None:
                self.engine.submit(free, "free_unjoined")

            if pending is not None:
                pending.cancel()  # not started yet: it never will
                pending.add_done_callback(free_later)
            else:
                free_later()
            raise
        except InvalidRequestError as e:
            self.kv_loader.release_remote(remote)
            await self.invalid(context, e)
        except (PullFailed, KVTransferError, KVCompatibilityError, grpc.aio.AioRpcError) as e:
            if load is not None:
                await self.engine.run(free)
            self.metrics.kv_failures.inc()
            if isinstance(e, KVCompatibilityError):
                await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(e))
            if self.args.kv_pull_failure_policy == "fail":
                await context.abort(grpc.StatusCode.UNAVAILABLE, f"KV pull failed: {e}")
            logger.warning("kv_pull_failed request_id=%s policy=recompute error=%s", request.request_id, e)
            self.metrics.kv_recomputes.inc()
            self.kv_loader.release_remote(remote)
            if not made:  # the lease expired before the request was made
                try:
                    await self.engine.run(make)
                except InvalidRequestError as invalid:
                    await self.invalid(context, invalid)
            return made[0], None, {"kv_recomputed": True}, False
        self.kv_loader.release_remote(remote)
        assert load is not None
        req = made[0]
        if load.num_blocks:
            self.metrics.observe_kv_pull(result.num_bytes, result.seconds, result.num_descriptors)
        logger.debug("kv_load request_id=%s local_tokens=%d remote_tokens=%d blocks=%d bytes=%d", req.request_id,
                     load.num_local_tokens, load.num_remote_tokens, load.num_blocks, result.num_bytes)  # fmt: skip
        transfer = {"kv_transfer_bytes": result.num_bytes, "kv_transfer_seconds": time.perf_counter() - start}
        try:
            local = bool(last_peer) and self.connector.reads_locally(last_peer)
        except KVTransferError:  # the peer was removed since (a prefill worker that left)
            local = False
        return req, (lambda r: connector.finish_load(r, load)), transfer, local

    def _release(self, remote: RemoteKV) -> None:
        """Event loop: tell the prefill worker its leased blocks may go (in the background; failures logged)."""
        self.background.spawn(self._release_rpc(remote), "kv_release")

    async def _release_rpc(self, remote: RemoteKV) -> None:
        try:
            await self._stub(remote.endpoint).ReleaseKV(
                pb.ReleaseKVRequest(request_id=remote.remote_request_id), timeout=5
            )
        except grpc.aio.AioRpcError as e:
            logger.info("kv_release_failed request_id=%s error=%s", remote.remote_request_id, e.code())


def remote_kv(handle: pb.KVHandle, peer_id: str) -> RemoteKV:
    """The engine's view of a KV handle."""
    return RemoteKV(
        remote_request_id=handle.request_id, peer_id=peer_id, endpoint=handle.prefill_worker_addr,
        block_ids=tuple(handle.block_ids), num_tokens=handle.num_tokens,
    )  # fmt: skip


def add_servicer(worker: DecodeWorker, server) -> None:
    pb_grpc.add_DecodeWorkerServicer_to_server(worker, server)


def main(argv: list[str] | None = None) -> int:
    return worker_main(build_decode_parser(), DecodeWorker, add_servicer, argv)
