"""KV events, the router's index and kv_aware routing, on 2 prefill + 2 decode workers and a real Redis."""

from __future__ import annotations

import asyncio
import json
import random
import time
import urllib.request

import grpc
import openai
import pytest

from services.common.registry import connect, read_registry
from services.router.kv_index import hashes_digest
from shared.engine.prefix_hash import block_hashes
from shared.genproto.cleave.v1 import worker_pb2 as pb
from shared.genproto.cleave.v1 import worker_pb2_grpc as pb_grpc
from tests.integration.cluster import scrape, start_router, start_worker, wait_worker

# 128 blocks of 16 tokens per worker: a handful of 1,000-token prompts forces evictions.
SMALL_CACHE = ["--kv-cache-memory", "1MiB", "--kv-transfer-backend", "tcp"]
PREFIX_LEN = 992  # 62 full blocks


def cached(proc) -> pb.ListCachedBlocksResponse:
    with grpc.insecure_channel(proc.info["grpc"]) as channel:
        stub_cls = pb_grpc.PrefillWorkerStub if proc.name == "prefill" else pb_grpc.DecodeWorkerStub
        return stub_cls(channel).ListCachedBlocks(pb.ListCachedBlocksRequest(), timeout=10)


def index_summary(base: str) -> dict:
    with urllib.request.urlopen(base + "/kv_index", timeout=5) as resp:
        return json.loads(resp.read())


def wait_index_in_sync(base: str, workers, timeout: float = 30.0) -> dict:
    """Poll until the router's index equals every worker's own cache listing."""
    deadline = time.monotonic() + timeout
    while True:
        summary = index_summary(base)["workers"]
        expected = {}
        for w in workers:
            hashes = cached(w).block_hashes
            expected[w.info["worker_id"]] = {"blocks": len(hashes), "digest": hashes_digest(hashes)}
        got = {wid: summary.get(wid, {"blocks": 0, "digest": hashes_digest([])}) for wid in expected}
        if got == expected:
            return summary
        assert time.monotonic() < deadline, f"index {got} != caches {expected}"
        time.sleep(0.2)


def settled(proc, name: str) -> float:
    """A counter's value once it stops moving (workers export counters about once a second)."""
    value = scrape(proc.info["metrics_port"], name)
    while True:
        time.sleep(1.2)
        again = scrape(proc.info["metrics_port"], name)
        if again == value:
            return value
        value = again


def wait_metric_rise(proc, name: str, before: float, timeout: float = 15.0) -> float:
    deadline = time.monotonic() + timeout
    while (value := scrape(proc.info["metrics_port"], name)) <= before:
        assert time.monotonic() < deadline, f"{name} on {proc.info['worker_id']} stayed at {before}"
        time.sleep(0.2)
    return value


@pytest.fixture(scope="module")
def kv_cluster(checkpoint_factory):
    from tests.helpers.redis_server import RedisServer

    redis = RedisServer()
    redis.start()
    model = checkpoint_factory("llama", max_position_embeddings=2048)
    flags = ["--redis-url", redis.url, *SMALL_CACHE]
    procs = [start_worker(role, model, *flags) for role in ("prefill", "prefill", "decode", "decode")]
    try:
        for p in procs:
            wait_worker(p)
        router, base = start_router(model, [], [], "--redis-url", redis.url)
        eager, eager_base = start_router(model, [], [], "--redis-url", redis.url, "--disagg-min-uncached-tokens", "0")
        vocab = json.loads((model / "config.json").read_text())["vocab_size"]
        yield procs, base, eager_base, vocab, redis
    finally:
        for p in [*procs, locals().get("router"), locals().get("eager")]:
            if p is not None:
                p.stop()
        redis.stop()


def complete(base: str, prompt: list[int]) -> None:
    client = openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=120)
    name = client.models.list().data[0].id
    out = client.completions.create(model=name, prompt=prompt, max_tokens=3, temperature=0,
                                    extra_body={"ignore_eos": True})  # fmt: skip
    assert out.usage.completion_tokens == 3


@pytest.mark.slow
def test_index_equals_union_of_worker_caches_with_evictions(kv_cluster):
    procs, base, _, vocab, redis = kv_cluster
    rng = random.Random(1)
    prompts = [[rng.randrange(3, vocab) for _ in range(PREFIX_LEN + 8)] for _ in range(6)]
    for prompt in prompts:
        complete(base, prompt)
    summary = wait_index_in_sync(base, procs)
    # The router hashes with the block size and seed from the registry, exactly as the workers do.
    entries = asyncio.run(_registry(redis.url))
    assert {e.block_size for e in entries} == {16} and {e.hash_seed for e in entries} == {""}
    every = {h for p in prompts for h in block_hashes(p, 16)}
    held = set().union(*(set(cached(w).block_hashes) for w in procs))
    assert held <= every and len(every - held) > 0, "the workload should have evicted blocks"
    prefill_blocks = sum(summary[p.info["worker_id"]]["blocks"] for p in procs[:2])
    assert prefill_blocks <= 2 * 128


async def _registry(url: str):
    client = connect(url)
    try:
        return await read_registry(client)
    finally:
        await client.aclose()


@pytest.mark.slow
def test_follow_up_goes_where_its_prefix_is_cached(kv_cluster):
    procs, base, eager_base, vocab, _ = kv_cluster
    prefills, decodes = procs[:2], procs[2:]
    rng = random.Random(2)
    prefix = [rng.randrange(3, vocab) for _ in range(PREFIX_LEN)]
    suffix = [[rng.randrange(3, vocab) for _ in range(24)] for _ in range(3)]
    complete(base, prefix + suffix[0])
    wait_index_in_sync(base, procs)
    prefix_hashes = set(block_hashes(prefix, 16))
    holder = next(d for d in decodes if prefix_hashes <= set(cached(d).block_hashes))
    other = next(d for d in decodes if d is not holder)
    hits = settled(holder, "cleave_prefix_cache_hits_total")
    pulled = settled(holder, "cleave_kv_transfer_bytes_total")
    other_tokens = settled(other, "cleave_generation_tokens_total")
    # A second turn: the decode worker that holds the history runs it whole, with no KV pulled.
    complete(base, prefix + suffix[1])
    assert wait_metric_rise(holder, "cleave_prefix_cache_hits_total", hits) - hits >= PREFIX_LEN // 16
    assert scrape(holder.info["metrics_port"], "cleave_kv_transfer_bytes_total") == pulled
    assert settled(other, "cleave_generation_tokens_total") == other_tokens

    # Always disaggregated: the prefill worker that holds the prefix computes only the rest.
    p_holder = next(p for p in prefills if prefix_hashes <= set(cached(p).block_hashes))
    p_other = next(p for p in prefills if p is not p_holder)
    hits = settled(p_holder, "cleave_prefix_cache_hits_total")
    other_prompt = settled(p_other, "cleave_prompt_tokens_total")
    wait_index_in_sync(eager_base, procs)
    complete(eager_base, prefix + suffix[2])
    assert wait_metric_rise(p_holder, "cleave_prefix_cache_hits_total", hits) - hits >= PREFIX_LEN // 16
    assert settled(p_other, "cleave_prompt_tokens_total") == other_prompt


@pytest.mark.slow
def test_redis_outage_then_index_recovers(kv_cluster):
    procs, base, _, vocab, redis = kv_cluster
    rng = random.Random(3)
    redis.stop()
    for _ in range(3):  # routed on the last registry and index the router saw
        complete(base, [rng.randrange(3, vocab) for _ in range(200)])
    redis.start()
    # Batches published while Redis was down are lost: the router sees the gap and takes snapshots.
    wait_index_in_sync(base, procs, timeout=60)
    complete(base, [rng.randrange(3, vocab) for _ in range(200)])
    wait_index_in_sync(base, procs, timeout=30)
