"""The float32 CPU stack as one native call equals the model's own module forward bit for bit."""

from __future__ import annotations

import pytest
import torch

from shared.kernels import cpu_kernels
from shared.kernels.torch_ref import TorchAttentionBackend
from shared.models.cpu_stack import torch_sgemm
from shared.models.loader import load_model
from tests.helpers.paged import PagedSequences

pytestmark = pytest.mark.skipif(cpu_kernels.load() is None, reason="no C compiler to build the CPU kernels")

BLOCK_SIZE = 16


def _run(model, path: str, kv_dtype: torch.dtype | None = None) -> tuple[list[dict[int, torch.Tensor]], torch.Tensor]:
    backend = TorchAttentionBackend()
    if path == "modules":
        model._cpu_stacks[type(backend)] = None
    gen = torch.Generator().manual_seed(5)
    prompts = [torch.randint(4, model.config.vocab_size, (n,), generator=gen).tolist() for n in (70, 9, 40)]
    paged = PagedSequences(model, backend, BLOCK_SIZE, max_len=96, num_seqs=3, seed=7, kv_dtype=kv_dtype)
    outs = [
        paged.step({0: prompts[0][:37], 1: prompts[1]}),  # a chunk, a whole prompt
        paged.step({0: prompts[0][37:], 1: [11], 2: prompts[2]}),  # the rest, a decode row, a prompt: mixed
        paged.step({0: [12], 1: [13], 2: [14]}),  # pure decode
        paged.step({0: [15], 1: [16], 2: [17]}),
    ]
    return outs, paged.kv_cache


@pytest.mark.parametrize(
    "arch,sizes",
    [("llama", {}), ("mistral", {}), ("llama3", {"head_dim": 64, "num_attention_heads": 6, "hidden_size": 384})],
)
def test_stack_matches_the_module_forward_exactly(checkpoint_factory, arch, sizes):
    model_dir = checkpoint_factory(arch, **sizes)
    fast_model, _ = load_model(model_dir, dtype="float32")
    if torch_sgemm() is None:
        pytest.skip("torch's CPU library exports no sgemm_ here")
    assert fast_model.cpu_stack(TorchAttentionBackend()) is not None
    slow_model, _ = load_model(model_dir, dtype="float32")
    fast, fast_cache = _run(fast_model, "native")
    slow, slow_cache = _run(slow_model, "modules")
    for step_fast, step_slow in zip(fast, slow, strict=True):
        for seq in step_slow:
            assert torch.equal(step_fast[seq], step_slow[seq])
    assert torch.equal(fast_cache, slow_cache)


def test_stack_matches_the_module_forward_on_a_bfloat16_cache(checkpoint_factory):
    """float32 weights over a bfloat16 KV cache: the one call writes and reads it as the modules do."""
    model_dir = checkpoint_factory("llama")
    fast_model, _ = load_model(model_dir, dtype="float32")
    slow_model, _ = load_model(model_dir, dtype="float32")
    stack = fast_model.cpu_stack(TorchAttentionBackend())
    if stack is None:
        pytest.skip("no projection kernel for the native forward here")
    calls, native = [], stack.native
    stack.native = lambda *args: calls.append(1) or native(*args)
    fast, fast_cache = _run(fast_model, "native", torch.bfloat16)
    assert len(calls) == 4  # every step in the one call
    slow, slow_cache = _run(slow_model, "modules", torch.bfloat16)
    assert fast_cache.dtype == torch.bfloat16 and fast_cache.abs().sum() > 0
    assert all(torch.equal(f[s], w[s]) for f, w in zip(fast, slow, strict=True) for s in w)
    assert torch.equal(fast_cache, slow_cache)
    # Close to the float32 cache's logits (only K and V are rounded), and not equal to them.
    exact, _ = _run(slow_model, "modules")
    torch.testing.assert_close(slow[-1][0], exact[-1][0], atol=0.05, rtol=0.05)
    assert not torch.equal(slow[-1][0], exact[-1][0])


@pytest.mark.skipif(not cpu_kernels.amx(), reason="no AMX on this CPU")
def test_stack_matches_the_module_forward_on_amx(checkpoint_factory):
    """A bfloat16 checkpoint in float32 with its projections on AMX: the one call and the modules agree too."""
    model_dir = checkpoint_factory("llama", dtype="bfloat16")
    fast_model, _ = load_model(model_dir, dtype="float32")
    slow_model, _ = load_model(model_dir, dtype="float32")
    for model in (fast_model, slow_model):
        cpu_kernels.mark_bfloat16_values(model.projection_weights())
    assert fast_model.cpu_stack(TorchAttentionBackend()) is not None
    fast, fast_cache = _run(fast_model, "native")
    slow, slow_cache = _run(slow_model, "modules")
    assert all(torch.equal(f[s], w[s]) for f, w in zip(fast, slow, strict=True) for s in w)
    assert torch.equal(fast_cache, slow_cache)
    assert cpu_kernels.amx_weight(fast_model.decoder_layers()[0].mlp.down_proj.weight) is not None


@pytest.mark.parametrize("arch", ["qwen2", "qwen3"])
def test_stack_declines_what_the_fused_path_does_not_do(checkpoint_factory, arch):
    """q/k/v biases (Qwen2) and per-head q/k norms (Qwen3) keep the module path."""
    model, _ = load_model(checkpoint_factory(arch), dtype="float32")
    assert model.cpu_stack(TorchAttentionBackend()) is None


def test_bfloat16_keeps_the_module_path(checkpoint_factory):
    model, _ = load_model(checkpoint_factory("llama"), dtype="bfloat16")
    assert model.cpu_stack(TorchAttentionBackend()) is None


def _replace_down(m) -> None:  # new storage
    down = m.decoder_layers()[0].mlp.down_proj
    down.weight = torch.nn.Parameter(down.weight.detach() * 2)


def _overwrite_qkv(m) -> None:  # same storage, new values: the packed copy must be made again
    with torch.no_grad():
        m.decoder_layers()[0].self_attn.qkv_proj.weight.mul_(-0.5)


@pytest.mark.parametrize("change", [_replace_down, _overwrite_qkv])
def test_native_forward_follows_a_changed_weight(checkpoint_factory, change):
    """A parameter given new storage, or written in place, after the stack was built and used is read anew."""
    model_dir = checkpoint_factory("llama")
    model, _ = load_model(model_dir, dtype="float32")
    if model.cpu_stack(TorchAttentionBackend()) is None:
        pytest.skip("no native forward here")
    reference, _ = load_model(model_dir, dtype="float32")
    _run(model, "native")  # built, packed and used once
    for m in (model, reference):
        change(m)
    fast, fast_cache = _run(model, "native")
    slow, slow_cache = _run(reference, "modules")
    assert all(torch.equal(f[s], w[s]) for f, w in zip(fast, slow, strict=True) for s in w)
    assert torch.equal(fast_cache, slow_cache)


def test_the_engine_builds_the_native_forward_at_start(checkpoint_factory):
    """The stack and the packed weights are made when the engine starts, not in its first request's step."""
    from shared.config import EngineConfig
    from shared.engine.engine_core import EngineCore

    engine = EngineCore(EngineConfig(model=str(checkpoint_factory("llama")), dtype="float32", num_blocks=32))
    model = engine.runner.model
    backend_type = type(engine.runner.attn_backend)
    assert backend_type in model._cpu_stacks  # built (None only where it does not apply)
    head = model.output_weight
    lib = cpu_kernels.load()
    packs = hasattr(lib, "linear_f32_packed_floats") and lib.linear_f32_packed_floats(8, 8) > 0
    if packs and cpu_kernels.native_linear() and cpu_kernels._packing_enabled:
        assert getattr(head, cpu_kernels.PACKED_ATTR)[2] is not None
        qkv = model.decoder_layers()[0].self_attn.qkv_proj.weight
        assert model._cpu_stacks[backend_type] is None or getattr(qkv, cpu_kernels.PACKED_ATTR)[2] is not None
