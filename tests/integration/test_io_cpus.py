"""``--io-cpus``: a worker's network threads move to the CPUs named, its engine thread stays where the
worker started, and the worker still serves."""

from __future__ import annotations

import os

import grpc
import pytest

from shared.genproto.cleave.v1 import worker_pb2 as pb
from shared.genproto.cleave.v1 import worker_pb2_grpc as pb_grpc
from tests.integration.cluster import start_worker, wait_worker


def _affinities(pid: int) -> list[set[int]]:
    return [os.sched_getaffinity(int(tid)) for tid in os.listdir(f"/proc/{pid}/task")]


def test_network_threads_move_and_the_engine_thread_stays(checkpoint_factory):
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        pytest.skip("needs two CPUs")
    io = {cpus[0]}
    proc = wait_worker(start_worker("decode", checkpoint_factory("llama"), "--io-cpus", str(cpus[0])))
    try:
        pid = proc.popen.pid
        assert os.sched_getaffinity(pid) == io  # the main thread: the event loop and its gRPC server
        assert set(cpus) in _affinities(pid)  # the engine thread, started before the move
        assert any(f"network_threads cpus={cpus[0]} engine_cpus=" in line for line in proc.lines)
        with grpc.insecure_channel(proc.info["grpc"]) as channel:
            stub = pb_grpc.DecodeWorkerStub(channel)
            sampling = pb.SamplingParams(n=1, temperature=0.0, top_p=1.0, repetition_penalty=1.0, max_tokens=3,
                                         ignore_eos=True)  # fmt: skip
            request = pb.GenerateRequest(request_id="io-cpus", prompt_token_ids=[5, 6, 7], sampling=sampling)
            tokens = [t.token_id for msg in stub.Generate(request, timeout=60) for t in msg.tokens]
        assert len(tokens) == 3
    finally:
        proc.stop()
