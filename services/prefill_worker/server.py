"""Prefill worker: computes a prompt's KV and first token, then holds the blocks
under a lease until a decode worker has pulled them (or the lease expires)."""

from __future__ import annotations

import argparse
import asyncio
import logging
import time

import grpc
from opentelemetry.trace import Span, SpanKind

from services.common.convert import sampling_from_proto, token_to_proto
from services.common.worker import WorkerBase, build_parser
from services.common.worker import main as worker_main
from services.kv_transfer.handshake import PROTOCOL_VERSION
from shared.cli import env_default
from shared.engine.async_engine import NewRequest
from shared.engine.request import Request, RequestStatus
from shared.engine.sampling_params import InvalidRequestError
from shared.genproto.cleave.v1 import worker_pb2 as pb
from shared.genproto.cleave.v1 import worker_pb2_grpc as pb_grpc

logger = logging.getLogger("cleave.prefill")


def build_prefill_parser() -> argparse.ArgumentParser:
    parser = build_parser("prefill")
    parser.add_argument("--kv-lease-seconds", type=float, default=float(env_default("--kv-lease-seconds", 30.0)),
                        help="how long finished prefills hold their blocks for a decode worker")  # fmt: skip
    parser.add_argument("--advertise-addr", default=env_default("--advertise-addr", None),
                        help="gRPC address decode workers use to reach this worker (default host:port)")  # fmt: skip
    return parser


class PrefillWorker(WorkerBase):
    """Leases live in the engine (``core.leases``): granted in the step that finishes
    the prefill, freed by ``ReleaseKV``, ``Abort`` or expiry on the engine thread."""

    role = "prefill"

    async def Prefill(self, request: pb.PrefillRequest, context) -> pb.PrefillResponse:
        await self.admit(context)
        with self.drain.track(), self.tracing.span("prefill", self.parent_context(context), SpanKind.SERVER,
                                                   attributes={"cleave.request_id": request.request_id}) as span:  # fmt: skip
            return await self._prefill(request, context, span)

    async def _prefill(self, request: pb.PrefillRequest, context, span: Span) -> pb.PrefillResponse:
        core = self.engine.core
        try:
            params = sampling_from_proto(request.sampling)
            await self.compile_constraint(params)
            if params.n != 1:
                raise InvalidRequestError("prefill handles n=1 requests; fan out n>1 before")
        except InvalidRequestError as e:
            await self.invalid(context, e)
        made: list[Request] = []

        def prepare(r: Request) -> None:  # on the engine thread, before the request is queued
            r.prefill_only = True
            r.kv_lease_seconds = self.args.kv_lease_seconds
            made.append(r)

        last = None
        try:  # made and queued in one engine command
            async for delta in self.stream(NewRequest(request.request_id, list(request.prompt_token_ids), params,
                                                      prepare)):  # fmt: skip
                last = delta
        except InvalidRequestError as e:
            await self.invalid(context, e)
        [req] = made
        assert last is not None and last.finished
        if span.is_recording():
            queued = (req.scheduled_time or req.arrival_time) - req.arrival_time
            span.set_attributes({"cleave.queue_time_seconds": queued, "cleave.cached_tokens": last.num_cached_tokens,
                                 "cleave.computed_tokens": last.num_prompt_tokens - last.num_cached_tokens})  # fmt: skip
        response = pb.PrefillResponse(
            first_token=token_to_proto(last.new_samples[0]),
            num_prompt_tokens=last.num_prompt_tokens,
            num_cached_tokens=last.num_cached_tokens,
            prompt_logprobs=[token_to_proto(s) for s in last.prompt_logprobs or []],
        )
        if req.status != RequestStatus.FINISHED_PREFILLED:
            response.finish_reason = last.finish_reason or "stop"
            return response
        try:
            hold = await self.engine.run(lambda: core.leases.get(req.request_id))
        except asyncio.CancelledError:
            # Nobody will learn of the lease: free it now rather than at its deadline.
            self.engine.submit(lambda: core.abort(req.request_id), "abort_lease")
            raise
        if hold is None:
            # Aborted or expired in the instant before the reply; the worker itself is fine.
            await context.abort(grpc.StatusCode.ABORTED, f"the KV lease of {req.request_id} ended before the reply")
        response.kv_handle.CopyFrom(
            pb.KVHandle(
                protocol_version=PROTOCOL_VERSION,
                request_id=req.request_id,
                worker_id=self.worker_id,
                prefill_worker_addr=self.address,
                transfer_backend=self.connector.backend_name,
                block_ids=hold.block_ids,
                num_tokens=req.num_prompt_tokens,
                lease_deadline_unix=time.time() + (hold.deadline or 0.0) - time.monotonic(),
                compat_hash=self.peer_info.compat_hash,
                kv_peer_id=self.connector.name,
            )  # fmt: skip
        )
        return response

    async def ReleaseKV(self, request: pb.ReleaseKVRequest, context) -> pb.ReleaseKVResponse:
        released = await self.engine.run(lambda: self.engine.core.leases.release(request.request_id))
        return pb.ReleaseKVResponse(released=released)

    async def GetKVMetadata(self, request: pb.KVMetadataRequest, context) -> pb.KVMetadataResponse:
        info = self.peer_info
        if request.protocol_version != PROTOCOL_VERSION or request.compat_hash != info.compat_hash:
            await context.abort(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"KV compatibility mismatch: this prefill worker speaks protocol {PROTOCOL_VERSION} with "
                f"compat hash {info.compat_hash} (dtype {info.dtype}, block_size {info.block_size}, "
                f"layers {info.num_layers}, kv heads {info.num_kv_heads}, head_dim {info.head_dim}); the caller sent "
                f"protocol {request.protocol_version} hash {request.compat_hash}. Start both workers with the same "
                "model, --dtype and --block-size.",
            )
        return pb.KVMetadataResponse(protocol_version=PROTOCOL_VERSION, compat_hash=info.compat_hash,
                                     transfer_backend=self.connector.backend_name,
                                     metadata=self.connector.local_metadata())  # fmt: skip


def add_servicer(worker: PrefillWorker, server) -> None:
    pb_grpc.add_PrefillWorkerServicer_to_server(worker, server)


def main(argv: list[str] | None = None) -> int:
    return worker_main(build_prefill_parser(), PrefillWorker, add_servicer, argv)
