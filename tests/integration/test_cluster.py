"""The disaggregated cluster as real processes: router (FastAPI) + prefill and decode
workers (gRPC) moving KV blocks over NIXL or TCP, driven by the official openai client."""

from __future__ import annotations

import asyncio
import json
import time
import urllib.error
import urllib.request

import grpc
import openai
import pytest

from shared.engine import LLM, SamplingParams
from shared.genproto.cleave.v1 import worker_pb2 as pb
from shared.genproto.cleave.v1 import worker_pb2_grpc as pb_grpc
from tests.integration.cluster import scrape, start_router, start_worker, wait_worker

try:
    import nixl_cu12  # noqa: F401

    HAVE_NIXL = True
except ImportError:
    HAVE_NIXL = False

PROMPTS = ["the weather today", "once upon a time there was", "hello", "a long story about the sea and the ships"]
CHAT = [{"role": "user", "content": "tell me about the garden"}]
MAX_TOKENS = 12
SEED = 77


@pytest.fixture(scope="module")
def reference(model_dir):
    """Greedy outputs of the offline engine (itself checked against transformers)."""
    llm = LLM(model=str(model_dir), dtype="float32", num_blocks=256)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    texts = {p: llm.generate([p], params)[0].outputs[0].text for p in PROMPTS}
    # The template already carries BOS: like the router, do not add special tokens again.
    chat_ids = llm.tokenizer.encode(llm.tokenizer.apply_chat_template(CHAT), add_special_tokens=False)
    texts["chat"] = llm.generate([chat_ids], params)[0].outputs[0].text
    seeded = SamplingParams(temperature=0.9, seed=SEED, max_tokens=MAX_TOKENS, ignore_eos=True)
    texts |= {f"seeded:{p}": llm.generate([p], seeded)[0].outputs[0].text for p in PROMPTS[:2]}
    return texts


def _cluster(model_dir, backend: str, prefill: int = 1, **worker_extra):
    # The workers share this machine: over NIXL they read each other's blocks from process memory (the
    # default), over TCP through the backend (--no-kv-local-reads), so both paths run in a real cluster.
    extra = ["--kv-transfer-backend", backend, *(["--no-kv-local-reads"] if backend == "tcp" else [])]
    for key, value in worker_extra.items():
        extra += [f"--{key.replace('_', '-')}", str(value)]
    prefills = [start_worker("prefill", model_dir, *extra) for _ in range(prefill)]
    decodes = [start_worker("decode", model_dir, *extra)]
    for p in prefills + decodes:
        wait_worker(p)
    router, base = start_router(model_dir, prefills, decodes)
    return prefills, decodes, router, base


@pytest.fixture(scope="module", params=["nixl", "tcp"])
def cluster(request, model_dir):
    if request.param == "nixl" and not HAVE_NIXL:
        pytest.skip("nixl_cu12 is not installed")
    prefills, decodes, router, base = _cluster(model_dir, request.param)
    yield {"prefill": prefills[0], "decode": decodes[0], "router": router, "base": base, "backend": request.param}
    for p in [router, *decodes, *prefills]:
        p.stop()


def client(base: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=120)


def load_stats(proc) -> pb.LoadStatsResponse:
    with grpc.insecure_channel(proc.info["grpc"]) as channel:
        stub_cls = pb_grpc.PrefillWorkerStub if proc.name == "prefill" else pb_grpc.DecodeWorkerStub
        return stub_cls(channel).LoadStats(pb.LoadStatsRequest(), timeout=10)


def wait_all_free(*procs, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        stats = [load_stats(p) for p in procs]
        if all(s.num_free_blocks == s.num_total_blocks and s.num_running == 0 for s in stats):
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"blocks still in use: {stats}")
        time.sleep(0.2)


def test_completions_and_chat_match_offline(cluster, reference, model_dir):
    c = client(cluster["base"])
    name = c.models.list().data[0].id
    for prompt in PROMPTS:
        out = c.completions.create(model=name, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0,
                                   extra_body={"ignore_eos": True})  # fmt: skip
        assert out.choices[0].text == reference[prompt]
        assert out.usage.completion_tokens == MAX_TOKENS
        stream = c.completions.create(model=name, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0, stream=True,
                                      extra_body={"ignore_eos": True})  # fmt: skip
        assert "".join(ch.choices[0].text for ch in stream if ch.choices) == reference[prompt]
    chat = c.chat.completions.create(model=name, messages=CHAT, max_tokens=MAX_TOKENS, temperature=0,
                                     extra_body={"ignore_eos": True})  # fmt: skip
    assert chat.choices[0].message.content == reference["chat"]
    stream = c.chat.completions.create(model=name, messages=CHAT, max_tokens=MAX_TOKENS, temperature=0, stream=True,
                                       stream_options={"include_usage": True}, extra_body={"ignore_eos": True})  # fmt: skip
    chunks = list(stream)
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices) == reference["chat"]
    assert chunks[-1].usage.completion_tokens == MAX_TOKENS
    wait_all_free(cluster["prefill"], cluster["decode"])


def test_seeded_completions_match_offline(cluster, reference):
    """Seeded sampling across prefill (first token) and decode (the rest) draws what one engine draws."""
    c = client(cluster["base"])
    name = c.models.list().data[0].id
    for prompt in PROMPTS[:2]:
        out = c.completions.create(model=name, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0.9, seed=SEED,
                                   extra_body={"ignore_eos": True})  # fmt: skip
        assert out.choices[0].text == reference[f"seeded:{prompt}"]
        assert out.choices[0].text != reference[prompt], "sampled, not greedy"
    assert scrape(cluster["decode"].info["metrics_port"], "cleave_kv_transfer_bytes_total") > 0


def test_concurrent_streams_transfer_kv_and_leak_nothing(cluster, reference):
    decode_metrics = cluster["decode"].info["metrics_port"]
    before = scrape(decode_metrics, "cleave_kv_transfer_bytes_total")

    async def one(c, name, prompt):
        stream = await c.completions.create(model=name, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0,
                                            stream=True, extra_body={"ignore_eos": True})  # fmt: skip
        return prompt, "".join([ch.choices[0].text async for ch in stream if ch.choices])

    async def run():
        c = openai.AsyncOpenAI(base_url=cluster["base"] + "/v1", api_key="unused", max_retries=0, timeout=300)
        name = (await c.models.list()).data[0].id
        return await asyncio.gather(*(one(c, name, PROMPTS[i % len(PROMPTS)]) for i in range(32)))

    results = asyncio.run(run())
    assert all(text == reference[prompt] for prompt, text in results)
    moved = scrape(decode_metrics, "cleave_kv_transfer_bytes_total") - before
    assert moved > 0, "no KV bytes were transferred"
    if cluster["backend"] == "nixl":  # read from the prefill worker's memory (counted once a second)
        deadline = time.monotonic() + 10
        while scrape(decode_metrics, "cleave_kv_local_read_bytes_total") < moved and time.monotonic() < deadline:
            time.sleep(0.1)
        assert scrape(decode_metrics, "cleave_kv_local_read_bytes_total") >= moved
    else:
        assert scrape(decode_metrics, "cleave_kv_local_read_bytes_total") == 0
    assert load_stats(cluster["decode"]).transfer_backend == cluster["backend"]
    with urllib.request.urlopen(f"http://127.0.0.1:{decode_metrics}/metrics", timeout=5) as resp:
        assert f'backend="{cluster["backend"]}"' in resp.read().decode()
    wait_all_free(cluster["prefill"], cluster["decode"])


def test_client_disconnect_frees_decode_blocks(cluster):
    c = client(cluster["base"])
    name = c.models.list().data[0].id
    stream = c.completions.create(model=name, prompt="the weather", max_tokens=200, temperature=0, stream=True,
                                  extra_body={"ignore_eos": True})  # fmt: skip
    for i, _ in enumerate(stream):
        if i == 3:
            break
    stream.close()
    wait_all_free(cluster["prefill"], cluster["decode"], timeout=15)


def _http(base: str, path: str, body: bytes | None = None) -> tuple[int, dict]:
    req = urllib.request.Request(base + path, data=body, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=30) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_bad_requests_get_openai_errors_and_cluster_keeps_serving(cluster, reference, model_dir):
    base = cluster["base"]
    name = client(base).models.list().data[0].id
    cases = [
        (b"{not json", 400),
        (json.dumps({"model": name, "prompt": "hi", "max_tokens": "many"}).encode(), 400),
        (json.dumps({"model": name, "prompt": "hi", "max_tokens": -3}).encode(), 400),
        (json.dumps({"model": name, "prompt": "word " * 2000, "max_tokens": 4}).encode(), 400),
        (json.dumps({"model": "no-such-model", "prompt": "hi"}).encode(), 404),
    ]
    for body, status in cases:
        code, payload = _http(base, "/v1/completions", body)
        assert code == status, payload
        assert set(payload["error"]) >= {"message", "type"}
    out = client(base).completions.create(model=name, prompt=PROMPTS[0], max_tokens=MAX_TOKENS, temperature=0,
                                          extra_body={"ignore_eos": True})  # fmt: skip
    assert out.choices[0].text == reference[PROMPTS[0]]
