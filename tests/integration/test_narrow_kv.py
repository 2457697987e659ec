"""Narrow KV caches served by a real cluster: a bfloat16 checkpoint that ``--dtype auto`` runs in float32 on the
CPU with its KV cache in bfloat16, and a float32 one with ``--kv-cache-dtype fp8``; the prefill worker's blocks
move to the decode worker over TCP, and the streamed greedy texts equal the offline engine's with the same
settings."""

from __future__ import annotations

import asyncio

import openai
import pytest
import torch

from shared.engine import LLM, SamplingParams
from tests.integration.cluster import scrape, start_router, start_worker, wait_worker

PROMPTS = ["the weather today", "once upon a time there was", "hello", "a long story about the sea and the ships"]
MAX_TOKENS = 12


CASES = {  # checkpoint dtype, the workers' flags, the cache dtype they log
    "bfloat16": ("bfloat16", ["--dtype", "auto"], "bfloat16"),
    "fp8": ("float32", ["--dtype", "float32", "--kv-cache-dtype", "fp8"], "float8_e4m3fn"),
}


@pytest.mark.parametrize("case", CASES)
def test_narrow_kv_blocks_move_between_workers_and_match_offline(checkpoint_factory, case):
    checkpoint_dtype, flags, kv_dtype = CASES[case]
    model = checkpoint_factory("llama", dtype=checkpoint_dtype)
    settings = dict(zip([f.removeprefix("--").replace("-", "_") for f in flags[::2]], flags[1::2], strict=True))
    llm = LLM(model=str(model), num_blocks=256, **settings)
    assert llm.engine.runner.kv_cache.dtype == getattr(torch, kv_dtype)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    expected = [out.outputs[0].text for out in llm.generate(PROMPTS, params)]
    del llm

    extra = [*flags, "--kv-transfer-backend", "tcp", "--no-kv-local-reads"]
    workers = [start_worker("prefill", model, *extra), start_worker("decode", model, *extra)]
    router = None
    try:
        for w in workers:
            wait_worker(w)
            assert any(f"kv_dtype={kv_dtype} " in line for line in w.lines), w.lines[-20:]
        router, base = start_router(model, workers[:1], workers[1:])
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
