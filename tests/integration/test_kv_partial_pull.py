"""A decode worker pulls only the KV blocks its own prefix cache lacks (real prefill and
decode processes, real TCP transfers); greedy output equals the offline engine."""

from __future__ import annotations

import json
import random
import time

import grpc
import pytest

from shared.engine import LLM, SamplingParams
from shared.genproto.cleave.v1 import worker_pb2 as pb
from shared.genproto.cleave.v1 import worker_pb2_grpc as pb_grpc
from tests.integration.cluster import scrape, start_worker, wait_worker

BLOCK = 16
MAX_TOKENS = 6
BYTES_METRIC = "cleave_kv_transfer_bytes_total"


@pytest.fixture(scope="module")
def prompts(model_dir):
    vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    rng = random.Random(7)
    prefix = [rng.randrange(3, vocab) for _ in range(3 * BLOCK)]
    return {
        "warm": prefix + [rng.randrange(3, vocab) for _ in range(10)],
        "partial": prefix + [rng.randrange(3, vocab) for _ in range(30)],  # 78 tokens: 5 blocks, 3 cached
        "covered": list(prefix),  # 3 full blocks, all cached
        "announced": [rng.randrange(3, vocab) for _ in range(40)],
    }


@pytest.fixture(scope="module")
def expected(model_dir, prompts):
    llm = LLM(model=str(model_dir), dtype="float32", num_blocks=64)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    names = list(prompts)
    outs = llm.generate([prompts[n] for n in names], params)
    return {n: o.outputs[0].token_ids for n, o in zip(names, outs, strict=True)}


@pytest.fixture(scope="module")
def workers(model_dir):
    procs = [start_worker(role, model_dir, "--kv-transfer-backend", "tcp") for role in ("prefill", "decode")]
    try:
        yield tuple(wait_worker(p) for p in procs)
    finally:
        for p in procs:
            p.stop()


def block_bytes(model_dir) -> int:
    """One block across all layers, K and V, float32: [num_layers, 2, block_size, num_kv_heads, head_dim]."""
    cfg = json.loads((model_dir / "config.json").read_text())
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    kv_heads = cfg.get("num_key_value_heads", cfg["num_attention_heads"])
    return cfg["num_hidden_layers"] * 2 * BLOCK * kv_heads * head_dim * 4


def params() -> pb.SamplingParams:
    return pb.SamplingParams(n=1, temperature=0.0, top_p=1.0, repetition_penalty=1.0, max_tokens=MAX_TOKENS,
                             ignore_eos=True)  # fmt: skip


def generate(decode, request_id: str, prompt: list[int], first: pb.PrefillResponse | None = None, announce=False):
    """Run on the decode worker (with a KV handle when ``first`` is given); all tokens and the first message."""
    extra = {"first_token": first.first_token, "kv_handle": first.kv_handle} if first else {}
    with grpc.insecure_channel(decode.info["grpc"]) as ch:
        stream = pb_grpc.DecodeWorkerStub(ch).Generate(
            pb.GenerateRequest(request_id=request_id, prompt_token_ids=prompt, sampling=params(),
                               announce_admission=announce, **extra),
            timeout=60,
        )  # fmt: skip
        messages = list(stream)
    head = [first.first_token.token_id] if first else []
    return head + [t.token_id for m in messages for t in m.tokens], messages[0]


def disaggregated(prefill, decode, request_id: str, prompt: list[int], announce=False):
    with grpc.insecure_channel(prefill.info["grpc"]) as ch:
        first = pb_grpc.PrefillWorkerStub(ch).Prefill(
            pb.PrefillRequest(request_id=request_id, prompt_token_ids=prompt, sampling=params()), timeout=60
        )
    assert len(first.kv_handle.block_ids) == -(-len(prompt) // BLOCK)
    return generate(decode, request_id, prompt, first, announce)


def test_decode_worker_pulls_only_blocks_its_cache_lacks(workers, prompts, expected, model_dir):
    prefill, decode = workers
    port = decode.info["metrics_port"]
    tokens, _ = generate(decode, "warm", prompts["warm"])  # aggregated: caches the 3 prefix blocks here
    assert tokens == expected["warm"]
    before = scrape(port, BYTES_METRIC)

    tokens, head = disaggregated(prefill, decode, "partial", prompts["partial"])
    assert tokens == expected["partial"]
    missing = 5 - 3
    assert head.kv_transfer_bytes == missing * block_bytes(model_dir) and not head.kv_recomputed
    assert scrape(port, BYTES_METRIC) - before == missing * block_bytes(model_dir)

    before = scrape(port, BYTES_METRIC)
    transfers = scrape(port, "cleave_kv_transfers_total")
    tokens, head = disaggregated(prefill, decode, "covered", prompts["covered"])
    assert tokens == expected["covered"]
    assert head.kv_transfer_bytes == 0 and not head.kv_recomputed
    assert scrape(port, BYTES_METRIC) == before and scrape(port, "cleave_kv_transfers_total") == transfers
    # What the local cache supplied to the two pulls is counted apart (exported about once a second).
    deadline = time.monotonic() + 30
    while scrape(port, "cleave_kv_pull_cached_tokens_total") < 2 * 3 * BLOCK:
        assert time.monotonic() < deadline, "cleave_kv_pull_cached_tokens_total stayed short"
        time.sleep(0.2)
    assert scrape(port, "cleave_kv_pull_cached_tokens_total") == 2 * 3 * BLOCK


def test_an_announced_request_gets_a_message_without_tokens_once_its_kv_is_pulled(
    workers, prompts, expected, model_dir
):
    prefill, decode = workers
    tokens, head = disaggregated(prefill, decode, "announced", prompts["announced"], announce=True)
    assert tokens == expected["announced"]  # the tokens after the announcement are those of a plain pull
    assert list(head.tokens) == [] and head.finish_reason == ""
    assert head.kv_transfer_bytes == 3 * block_bytes(model_dir) and not head.kv_recomputed


def test_prefill_leases_are_released_and_decode_blocks_return(workers, prompts):
    prefill, decode = workers
    deadline = time.monotonic() + 30
    while True:
        with grpc.insecure_channel(prefill.info["grpc"]) as ch:
            p = pb_grpc.PrefillWorkerStub(ch).LoadStats(pb.LoadStatsRequest(), timeout=10)
        with grpc.insecure_channel(decode.info["grpc"]) as ch:
            d = pb_grpc.DecodeWorkerStub(ch).LoadStats(pb.LoadStatsRequest(), timeout=10)
        done = p.num_leased_requests == 0 and d.num_running == 0 and d.num_free_blocks == d.num_total_blocks
        if done:
            break
        assert time.monotonic() < deadline, (p, d)
        time.sleep(0.1)
