"""The CPU's default token budget per step follows the model's work per prompt token."""

from __future__ import annotations

from shared.config import CPU_STEP_FLOPS, CPU_STEP_TOKENS, CPU_STEP_TOKENS_MAX, EngineConfig, cpu_step_tokens
from shared.engine.engine_core import EngineCore
from shared.models.config import load_model_config


def test_cpu_step_tokens_is_the_largest_power_of_two_within_the_step_flops():
    # The 12M Llama's projections (9,437,184 weights) and SmolLM2-135M's (106,168,320).
    assert cpu_step_tokens(9_437_184) == 1024
    assert cpu_step_tokens(106_168_320) == CPU_STEP_TOKENS == 256
    assert cpu_step_tokens(1) == CPU_STEP_TOKENS_MAX  # a tiny model: the most
    assert cpu_step_tokens(10**10) == CPU_STEP_TOKENS  # a large one: the least
    for weights in (10**5, 10**6, 3 * 10**6, 10**7, 3 * 10**7):
        tokens = cpu_step_tokens(weights)
        assert tokens & (tokens - 1) == 0 and CPU_STEP_TOKENS <= tokens <= CPU_STEP_TOKENS_MAX
        assert tokens == CPU_STEP_TOKENS or 2 * weights * tokens <= CPU_STEP_FLOPS
        assert tokens == CPU_STEP_TOKENS_MAX or 2 * weights * 2 * tokens > CPU_STEP_FLOPS


def test_the_engine_takes_the_model_budget_unless_one_is_given(checkpoint_factory):
    model_dir = checkpoint_factory("llama")
    expected = cpu_step_tokens(load_model_config(str(model_dir)).layer_parameters)
    core = EngineCore(EngineConfig(model=str(model_dir), device="cpu", num_blocks=64))
    assert core.max_num_batched_tokens == core.scheduler.config.max_num_batched_tokens == expected
    given = EngineCore(EngineConfig(model=str(model_dir), device="cpu", num_blocks=64, max_num_batched_tokens=48))
    assert given.max_num_batched_tokens == given.scheduler.config.max_num_batched_tokens == 48
