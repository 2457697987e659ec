"""A worker killed with SIGKILL mid-stream: the client gets a clear end, nothing hangs,
and the cluster keeps serving on the workers that are left."""

from __future__ import annotations

import signal
import time

import openai
import pytest

from tests.integration.cluster import start_router, start_worker, wait_worker


@pytest.fixture()
def cluster(checkpoint_factory):
    # A long context, so the stream is still running when its worker is killed.
    model_dir = checkpoint_factory("llama", max_position_embeddings=4096)
    prefill = wait_worker(start_worker("prefill", model_dir, "--kv-transfer-backend", "tcp"))
    decodes = [wait_worker(start_worker("decode", model_dir, "--kv-transfer-backend", "tcp")) for _ in range(2)]
    router, base = start_router(model_dir, [prefill], decodes, "--migration-limit", "0")
    yield prefill, decodes, router, base
    for p in [router, prefill, *decodes]:
        p.stop()


def test_decode_worker_killed_mid_stream(cluster):
    from tests.integration.test_cluster import load_stats

    prefill, decodes, router, base = cluster
    client = openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=60)
    name = client.models.list().data[0].id
    stream = client.completions.create(model=name, prompt="the weather", max_tokens=4000, temperature=0,
                                       stream=True, extra_body={"ignore_eos": True})  # fmt: skip
    chunks = iter(stream)
    next(chunks)
    next(chunks)
    victim = next(d for d in decodes if load_stats(d).num_running == 1)
    survivor = next(d for d in decodes if d is not victim)
    victim.popen.send_signal(signal.SIGKILL)
    start = time.monotonic()
    with pytest.raises(openai.APIError):
        for _ in chunks:
            pass
    assert time.monotonic() - start < 30, "the stream did not end promptly after its worker died"
    # New requests go to the surviving decode worker.
    out = client.completions.create(model=name, prompt="hello", max_tokens=4, temperature=0,
                                    extra_body={"ignore_eos": True})  # fmt: skip
    assert out.usage.completion_tokens == 4
    stats = load_stats(survivor)
    assert stats.num_running == 0 and stats.num_free_blocks == stats.num_total_blocks


def test_dead_prefill_worker_falls_back_to_aggregated(cluster):
    prefill, decodes, router, base = cluster
    client = openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=60)
    name = client.models.list().data[0].id
    before = client.completions.create(model=name, prompt="the garden", max_tokens=6, temperature=0,
                                       extra_body={"ignore_eos": True})  # fmt: skip
    prefill.popen.send_signal(signal.SIGKILL)
    prefill.popen.wait()
    after = client.completions.create(model=name, prompt="the garden", max_tokens=6, temperature=0,
                                      extra_body={"ignore_eos": True})  # fmt: skip
    assert after.choices[0].text == before.choices[0].text
