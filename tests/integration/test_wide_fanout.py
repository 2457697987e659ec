"""A wide fan-out of concurrent calls on one worker: every call is served, none is
CANCELLED by gRPC's limits on calls the server has not picked up yet."""

from __future__ import annotations

import asyncio
from collections import Counter

import grpc
import pytest

from shared.genproto.cleave.v1 import worker_pb2 as pb
from shared.genproto.cleave.v1 import worker_pb2_grpc as pb_grpc
from tests.integration.cluster import start_worker, wait_worker

NUM_CALLS = 4000  # above the C core's default hard limit of 3,000 pending calls


@pytest.fixture(scope="module")
def prefill(model_dir):
    proc = wait_worker(start_worker("prefill", model_dir, "--kv-transfer-backend", "tcp"))
    yield proc
    proc.stop()


async def fan_out(address: str) -> Counter[str]:
    outcomes: Counter[str] = Counter()
    async with grpc.aio.insecure_channel(address) as channel:
        stub = pb_grpc.PrefillWorkerStub(channel)

        async def one() -> None:
            try:
                await stub.LoadStats(pb.LoadStatsRequest(), timeout=120)
                outcomes["OK"] += 1
            except grpc.aio.AioRpcError as e:
                outcomes[e.code().name] += 1

        await asyncio.gather(*(one() for _ in range(NUM_CALLS)))
    return outcomes


@pytest.mark.slow
def test_thousands_of_concurrent_calls_are_all_served(prefill):
    outcomes = asyncio.run(fan_out(prefill.info["grpc"]))
    assert outcomes == {"OK": NUM_CALLS}
