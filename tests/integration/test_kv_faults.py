"""KV hand-off faults between real worker processes: lease expiry, compatibility
mismatch, failed pulls falling back to recompute (and the ``fail`` policy)."""

from __future__ import annotations

import time

import grpc
import pytest

from shared.engine import LLM, SamplingParams
from shared.genproto.cleave.v1 import worker_pb2 as pb
from shared.genproto.cleave.v1 import worker_pb2_grpc as pb_grpc
from tests.integration.cluster import start_worker, wait_worker

PROMPT = list(range(40, 90))  # 50 tokens: several full blocks and a partial one
MAX_TOKENS = 10


@pytest.fixture(scope="module")
def expected(model_dir):
    llm = LLM(model=str(model_dir), dtype="float32", num_blocks=64)
    out = llm.generate([PROMPT], SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True))
    return out[0].outputs[0].token_ids


@pytest.fixture(scope="module")
def workers(model_dir):
    prefill = wait_worker(start_worker("prefill", model_dir, "--kv-lease-seconds", "3", "--kv-transfer-backend", "tcp"))
    decode = wait_worker(start_worker("decode", model_dir, "--kv-transfer-backend", "tcp"))
    strict = wait_worker(
        start_worker("decode", model_dir, "--kv-transfer-backend", "tcp", "--kv-pull-failure-policy", "fail")
    )
    yield prefill, decode, strict
    for p in (prefill, decode, strict):
        p.stop()


def params() -> pb.SamplingParams:
    return pb.SamplingParams(
        n=1, temperature=0.0, top_p=1.0, repetition_penalty=1.0, max_tokens=MAX_TOKENS, ignore_eos=True
    )


def prefill(proc, request_id: str) -> pb.PrefillResponse:
    with grpc.insecure_channel(proc.info["grpc"]) as ch:
        return pb_grpc.PrefillWorkerStub(ch).Prefill(
            pb.PrefillRequest(request_id=request_id, prompt_token_ids=PROMPT, sampling=params()), timeout=60
        )


def generate(
    proc, request_id: str, first: pb.PrefillResponse, announce: bool = False
) -> tuple[list[int], pb.GenerateResponse]:
    with grpc.insecure_channel(proc.info["grpc"]) as ch:
        stream = pb_grpc.DecodeWorkerStub(ch).Generate(
            pb.GenerateRequest(
                request_id=request_id,
                prompt_token_ids=PROMPT,
                sampling=params(),
                first_token=first.first_token,
                kv_handle=first.kv_handle,
                announce_admission=announce,
            ),  # fmt: skip
            timeout=60,
        )
        messages = list(stream)
    tokens = [first.first_token.token_id] + [t.token_id for m in messages for t in m.tokens]
    return tokens, messages[0]


def stats(proc, stub_cls) -> pb.LoadStatsResponse:
    with grpc.insecure_channel(proc.info["grpc"]) as ch:
        return stub_cls(ch).LoadStats(pb.LoadStatsRequest(), timeout=10)


def test_pull_then_release(workers, expected):
    prefill_proc, decode_proc, _ = workers
    first = prefill(prefill_proc, "ok-1")
    assert first.kv_handle.num_tokens == len(PROMPT)
    tokens, head = generate(decode_proc, "ok-1", first)
    assert tokens == expected
    assert head.kv_transfer_bytes > 0 and not head.kv_recomputed
    # The release is sent right after the pull, well before the 3 s lease could run out.
    deadline = time.monotonic() + 2.5
    while True:
        s = stats(prefill_proc, pb_grpc.PrefillWorkerStub)
        if s.num_leased_requests == 0 or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert s.num_leased_requests == 0 and s.num_free_blocks == s.num_total_blocks


def test_lease_expires_and_frees_prefill_blocks(workers):
    prefill_proc, _, _ = workers
    prefill(prefill_proc, "lease-1")
    held = stats(prefill_proc, pb_grpc.PrefillWorkerStub)
    assert held.num_leased_requests == 1 and held.num_free_blocks < held.num_total_blocks
    time.sleep(4)
    s = stats(prefill_proc, pb_grpc.PrefillWorkerStub)
    assert s.num_leased_requests == 0 and s.num_free_blocks == s.num_total_blocks


def test_expired_lease_is_recomputed_with_same_greedy_tokens(workers, expected):
    prefill_proc, decode_proc, strict_proc = workers
    first = prefill(prefill_proc, "late-1")
    time.sleep(4)  # the lease (3 s) runs out before the decode side asks
    tokens, head = generate(decode_proc, "late-1", first)
    assert head.kv_recomputed and tokens == expected
    with pytest.raises(grpc.RpcError) as err:
        generate(strict_proc, "late-1", first)
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    s = stats(decode_proc, pb_grpc.DecodeWorkerStub)
    assert s.num_free_blocks == s.num_total_blocks


def test_compat_hash_mismatch_is_refused(workers):
    prefill_proc, decode_proc, _ = workers
    with grpc.insecure_channel(prefill_proc.info["grpc"]) as ch:
        with pytest.raises(grpc.RpcError) as err:
            pb_grpc.PrefillWorkerStub(ch).GetKVMetadata(
                pb.KVMetadataRequest(protocol_version=1, compat_hash="0000"), timeout=10
            )
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "block-size" in err.value.details()
    first = prefill(prefill_proc, "mismatch-1")
    first.kv_handle.compat_hash = "deadbeef"
    with pytest.raises(grpc.RpcError) as err:
        generate(decode_proc, "mismatch-1", first)
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION


def test_dead_prefill_worker_falls_back_to_recompute(model_dir, workers, expected):
    _, decode_proc, _ = workers
    doomed = wait_worker(start_worker("prefill", model_dir, "--kv-transfer-backend", "tcp"))
    first = prefill(doomed, "dead-1")
    doomed.stop(sig=9)
    tokens, head = generate(decode_proc, "dead-1", first, announce=True)
    assert head.kv_recomputed and tokens == expected
    assert head.tokens  # not announced: a prompt computed here leads with its next token, not a queue slot
