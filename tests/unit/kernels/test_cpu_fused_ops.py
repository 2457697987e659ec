"""The native fused RMSNorm and RoPE against the torch formulations the model uses otherwise."""

from __future__ import annotations

import pytest
import torch

from shared.kernels import cpu_kernels
from shared.models.llama import apply_rope

pytestmark = pytest.mark.skipif(cpu_kernels.load() is None, reason="no C compiler to build the CPU kernels")


def _torch_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


@pytest.mark.parametrize("rows,size", [(1, 384), (70, 64), (5, 37)])
def test_rms_norm_matches_torch(rows, size):
    gen = torch.Generator().manual_seed(rows)
    wide = torch.randn(rows, size + 9, generator=gen)
    x = wide[:, 3 : 3 + size]  # strided rows
    weight = torch.randn(size, generator=gen)
    out = cpu_kernels.rms_norm(x, weight, 1e-5)
    assert out is not None and out.is_contiguous()
    torch.testing.assert_close(out, _torch_rms_norm(x, weight, 1e-5), atol=1e-6, rtol=1e-6)
    assert cpu_kernels.rms_norm(x.double(), weight.double(), 1e-5) is None  # other dtypes: the torch path


@pytest.mark.parametrize("num_tokens", [1, 3, 100])
def test_rope_in_place_is_bit_identical_to_torch(num_tokens):
    gen = torch.Generator().manual_seed(num_tokens)
    num_heads, num_kv_heads, head_dim = 6, 2, 64
    qkv = torch.randn(num_tokens, (num_heads + 2 * num_kv_heads) * head_dim, generator=gen)
    angles = torch.rand(num_tokens, head_dim // 2, generator=gen) * 50
    cos, sin = torch.cat([angles, angles], -1).cos(), torch.cat([angles, angles], -1).sin()  # [T, head_dim]
    q = qkv[:, : num_heads * head_dim].reshape(num_tokens, num_heads, head_dim)
    k = qkv[:, num_heads * head_dim : (num_heads + num_kv_heads) * head_dim].reshape(num_tokens, num_kv_heads, head_dim)
    expected_q, expected_k = apply_rope(q, cos[:, None], sin[:, None]), apply_rope(k, cos[:, None], sin[:, None])
    v_before = qkv[:, (num_heads + num_kv_heads) * head_dim :].clone()
    assert cpu_kernels.rope_(qkv, num_heads + num_kv_heads, cos, sin)
    assert torch.equal(q, expected_q) and torch.equal(k, expected_k)
    assert torch.equal(qkv[:, (num_heads + num_kv_heads) * head_dim :], v_before)  # v untouched


@pytest.mark.parametrize("rows,size", [(1, 384), (400, 384), (5, 37)])
def test_add_rms_norm_adds_in_place_then_normalises(rows, size):
    gen = torch.Generator().manual_seed(rows + size)
    x = torch.randn(rows, size, generator=gen)
    residual = torch.randn(rows, size, generator=gen)
    weight = torch.randn(size, generator=gen)
    expected_sum = residual + x
    out = cpu_kernels.add_rms_norm_(x, residual, weight, 1e-5)
    assert out is not None
    assert torch.equal(residual, expected_sum)  # the same float32 additions as torch's
    torch.testing.assert_close(out, _torch_rms_norm(expected_sum, weight, 1e-5), atol=1e-6, rtol=1e-6)
    before = residual.clone()
    assert cpu_kernels.add_rms_norm_(x.double(), residual.double(), weight.double(), 1e-5) is None
    assert torch.equal(residual, before)  # declined: nothing changed


@pytest.mark.parametrize("rows,size", [(1, 1024), (300, 1024), (3, 29)])
def test_silu_mul_matches_torch(rows, size):
    gen = torch.Generator().manual_seed(rows * 3 + size)
    gate_up = torch.randn(rows, 2 * size, generator=gen) * 6  # tails of silu included
    out = cpu_kernels.silu_mul(gate_up, size)
    assert out is not None and out.shape == (rows, size)
    gate, up = gate_up.split(size, dim=-1)
    torch.testing.assert_close(out, torch.nn.functional.silu(gate) * up, atol=1e-6, rtol=1e-5)
    assert cpu_kernels.silu_mul(gate_up.double(), size) is None
