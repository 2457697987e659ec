"""A bfloat16 checkpoint served by a real cluster: ``--dtype auto`` runs it in float32 on the CPU with its KV
cache in bfloat16, the prefill worker's bfloat16 blocks move to the decode worker over TCP, and the streamed
greedy texts equal the offline engine's with the same settings."""

from __future__ import annotations

import asyncio

import openai
import pytest
import torch

from shared.engine import LLM, SamplingParams
from tests.integration.cluster import scrape, start_router, start_worker, wait_worker

PROMPTS = ["the weather today", "once upon a time there was", "hello", "a long story about the sea and the ships"]
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def bf16_model(checkpoint_factory):
    return checkpoint_factory("llama", dtype="bfloat16")


def test_bfloat16_blocks_move_between_workers_and_match_offline(bf16_model):
    llm = LLM(model=str(bf16_model), dtype="auto", num_blocks=256)
    assert llm.engine.runner.kv_cache.dtype == torch.bfloat16
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    expected = [out.outputs[0].text for out in llm.generate(PROMPTS, params)]
    del llm

    extra = ["--dtype", "auto", "--kv-transfer-backend", "tcp", "--no-kv-local-reads"]
    workers = [start_worker("prefill", bf16_model, *extra), start_worker("decode", bf16_model, *extra)]
    router = None
    try:
        for w in workers:
            wait_worker(w)
            assert any("kv_dtype=bfloat16" in line for line in w.lines), w.lines[-20:]
        router, base = start_router(bf16_model, workers[:1], workers[1:])
        client = openai.AsyncOpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=120)
        name = openai.OpenAI(base_url=base + "/v1", api_key="unused").models.list().data[0].id

        async def stream(prompt: str) -> str:
            chunks = await client.completions.create(model=name, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0,
                                                     stream=True, extra_body={"ignore_eos": True})  # fmt: skip
            return "".join([c.choices[0].text async for c in chunks if c.choices])

        async def all_streams() -> list[str]:
            return await asyncio.gather(*(stream(p) for p in PROMPTS))

        assert asyncio.run(all_streams()) == expected
        assert scrape(workers[1].info["metrics_port"], "cleave_kv_transfer_bytes_total") > 0
    finally:
        for p in [router, *workers]:
            if p is not None:
                p.stop()
