"""Seeded sampling continues exactly where another engine left off: the noise of output token ``i``
depends only on the seed and ``i``, so a request resumed elsewhere (a migration, or a decode worker
taking over after the prefill worker's first token) draws what an uninterrupted run draws."""

from __future__ import annotations

from dataclasses import replace

import pytest

from shared.config import EngineConfig
from shared.engine.engine_core import EngineCore
from shared.engine.sampler import token_seed
from shared.engine.sampling_params import SamplingParams

PROMPT = list(range(7, 30))
NUM_TOKENS = 24


def make_core(model_dir) -> EngineCore:
    return EngineCore(EngineConfig(model=str(model_dir), dtype="float32", num_blocks=64, block_size=4))


def run(core: EngineCore, request_id: str, params: SamplingParams, generated: list[int] | None = None) -> list[int]:
    """Every output token of one request (``generated`` first, when it resumes), run to the end alone."""
    request = core.make_request(request_id, PROMPT, params)
    if generated:
        core.resume(request, generated)
    core.scheduler.add_request(request)
    while core.has_unfinished():
        core.step()
    assert core.stats().num_free_blocks == core.num_blocks
    return list(request.output_token_ids)


@pytest.fixture(scope="module")
def model_dir(checkpoint_factory):
    return checkpoint_factory("llama")


@pytest.mark.parametrize("seed", [1234, -5, 2**63 - 1])
def test_a_seeded_request_resumed_on_a_fresh_engine_continues_its_uninterrupted_run(model_dir, seed):
    params = SamplingParams(temperature=1.0, top_k=50, seed=seed, max_tokens=NUM_TOKENS, ignore_eos=True)
    whole = run(make_core(model_dir), "whole", params)
    assert len(set(whole)) > 3, "sampled, not a constant stream"
    for num_before in (1, 9):
        assert run(make_core(model_dir), f"resumed-{num_before}", params, whole[:num_before]) == whole


def test_each_sample_of_a_fork_resumes_alone_with_its_own_seed(model_dir):
    """What a migration does with a fork: sample ``i`` goes on as a single request with seed + i."""
    seed = 2**63 - 2  # sample 2's seed wraps around int64, as the router sends it
    params = SamplingParams(n=3, temperature=1.0, top_k=50, seed=seed, max_tokens=NUM_TOKENS, ignore_eos=True)
    core = make_core(model_dir)
    core.scheduler.add_request(core.make_request("fork", PROMPT, params))
    samples: dict[int, list[int]] = {0: [], 1: [], 2: []}
    while core.has_unfinished():
        for delta in core.step():
            samples[delta.sample_index] += delta.new_token_ids
    assert len({tuple(tokens) for tokens in samples.values()}) == 3
    for index, tokens in samples.items():
        single = replace(params, n=1, seed=(seed + index + 2**63) % 2**64 - 2**63)
        assert run(make_core(model_dir), f"sample-{index}", single, tokens[:5]) == tokens


def test_the_noise_is_reproducible_and_distinct_per_seed_and_position():
    assert token_seed(7, 3) == token_seed(7, 3)
    # A seed and its int64 wrap-around (how a fork's sample seeds are sent) are the same seed.
    assert token_seed(-1, 0) == token_seed(2**64 - 1, 0)
    seeds = {token_seed(seed, index) for seed in range(-20, 20) for index in range(50)}
    assert len(seeds) == 40 * 50
    assert all(0 <= s < 2**63 for s in seeds)
