"""The native CPU prefill / chunked-prefill kernel and KV write against the torch reference."""

from __future__ import annotations

import pytest
import torch

from shared.kernels import cpu_kernels, torch_ref
from tests.helpers.paged import FP8_KV_DTYPES, KV_DTYPES, SeqChunk, build_metadata

pytestmark = pytest.mark.skipif(cpu_kernels.load() is None, reason="no C compiler to build the CPU kernels")


def _mixed_batch(block_size: int, gen: torch.Generator):
    # (cached tokens, new tokens): whole prompts, chunks after a cached prefix, decode rows,
    # tiles that end mid-block and new tokens that start mid-block; a long context that the AVX-512
    # path reads in several spans of blocks, its new tokens starting mid-span.
    shapes = [(0, 1), (0, 5), (0, 37), (block_size, block_size), (3, 40), (70, 1), (2 * block_size + 5, 17), (0, 100),
              (9 * block_size + 3, 70)]  # fmt: skip
    blocks_per_seq = [-(-(c + n) // block_size) for c, n in shapes]
    ids = torch.randperm(sum(blocks_per_seq) + 3, generator=gen).tolist()
    starts = [sum(blocks_per_seq[:i]) for i in range(len(shapes))]
    chunks = [SeqChunk(ids[s : s + b], c, n) for s, b, (c, n) in zip(starts, blocks_per_seq, shapes, strict=True)]
    meta, _ = build_metadata(chunks, block_size)
    return meta, len(ids)


@pytest.mark.parametrize("kv_dtype", KV_DTYPES)
@pytest.mark.parametrize(
    "block_size,group,head_dim",
    [(16, 3, 64), (16, 1, 32), (8, 4, 16), (32, 2, 64), (4, 5, 8), (16, 6, 128), (64, 1, 192)],
)
def test_prefill_kernel_matches_reference(block_size, group, head_dim, kv_dtype):
    gen = torch.Generator().manual_seed(block_size * 11 + group)
    meta, num_blocks = _mixed_batch(block_size, gen)
    num_kv_heads = 2
    # A bfloat16 or float8 cache: the reference reads it widened to float32, exactly what the kernel reads.
    kv_cache = torch.randn(num_blocks, 3, 2, block_size, num_kv_heads, head_dim, generator=gen).to(kv_dtype)
    k_cache, v_cache = kv_cache[:, 1, 0], kv_cache[:, 1, 1]  # strided layer views
    query = torch.randn(sum(meta.query_lens_cpu), num_kv_heads * group, head_dim, generator=gen)
    assert cpu_kernels.supports(query, k_cache, v_cache)
    ref = torch_ref.paged_attention(query, k_cache, v_cache, meta, 0.2)
    out = cpu_kernels.paged_prefill(
        query, k_cache, v_cache, meta.block_tables, meta.query_start_loc, meta.seq_lens, 0.2
    )
    assert out is not None
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=1e-4)
    fast = torch_ref.paged_attention_fast(query, k_cache, v_cache, meta, 0.2)  # the backend's route
    torch.testing.assert_close(fast, ref, atol=2e-5, rtol=1e-4)


def test_prefill_kernel_declines_unsupported_shapes():
    meta, _ = build_metadata([SeqChunk([0, 1], 0, 5)], 128)  # blocks larger than the kernel's scratch
    kv_cache = torch.randn(2, 1, 2, 128, 1, 16)
    query = torch.randn(5, 2, 16)
    k_cache, v_cache = kv_cache[:, 0, 0], kv_cache[:, 0, 1]
    args = (meta.block_tables, meta.query_start_loc, meta.seq_lens, 0.25)
    assert cpu_kernels.paged_prefill(query, k_cache, v_cache, *args) is None
    ref = torch_ref.paged_attention(query, k_cache, v_cache, meta, 0.25)
    torch.testing.assert_close(torch_ref.paged_attention_fast(query, k_cache, v_cache, meta, 0.25), ref)


@pytest.mark.parametrize("kv_dtype", KV_DTYPES)
def test_write_kv_matches_reference(kv_dtype):
    gen = torch.Generator().manual_seed(3)
    num_blocks, block_size, num_kv_heads, head_dim = 6, 4, 2, 8
    ours = torch.zeros(num_blocks, 2, 2, block_size, num_kv_heads, head_dim, dtype=kv_dtype)
    theirs = ours.clone()
    qkv = torch.randn(7, 3 * num_kv_heads * head_dim, generator=gen)
    # Values whose bfloat16 rounding is a tie (either way by the even rule), and ones just past a tie.
    qkv[0, :4] = torch.tensor([1 + 2**-8, 1 + 3 * 2**-8, -(1 + 2**-8), 1 + 2**-8 + 2**-20])
    key = qkv[:, : num_kv_heads * head_dim].reshape(7, num_kv_heads, head_dim)  # strided rows, as in the model
    value = qkv[:, num_kv_heads * head_dim : 2 * num_kv_heads * head_dim].reshape(7, num_kv_heads, head_dim)
    slots = torch.tensor([5, 6, 7, 8, 20, 0, 23])
    layer = 1
    assert cpu_kernels.supports_write(key, value, ours[:, layer, 0], ours[:, layer, 1])
    cpu_kernels.write_kv(key, value, ours[:, layer, 0], ours[:, layer, 1], slots)
    torch_ref.write_kv(key, value, theirs[:, layer, 0], theirs[:, layer, 1], slots)
    assert torch.equal(ours.view(torch.uint8), theirs.view(torch.uint8))  # bit for bit (float8 has no equal)
    assert ours[:, 0].float().abs().sum() == 0  # the other layer is untouched


@pytest.mark.parametrize("kv_dtype", FP8_KV_DTYPES)
def test_write_kv_rounds_to_float8_as_torch_does(kv_dtype):
    """Every kind of float32 into a float8 cache: random bit patterns (every exponent, so overflow, subnormal and
    underflowing values), values near the format's range and rounding ties, bit for bit what torch's conversion
    gives after the clamp to the largest finite value (which keeps e5m2 from rounding to infinity)."""
    gen = torch.Generator().manual_seed(11)
    bits = torch.randint(-(2**31), 2**31, (1 << 16,), generator=gen, dtype=torch.int64).to(torch.int32)
    patterns = bits.view(torch.float32)
    top, tiny = torch.finfo(kv_dtype).max, torch.finfo(kv_dtype).smallest_normal
    mant = 3 if kv_dtype == torch.float8_e4m3fn else 2
    unit = tiny * 2.0**-mant  # the smallest subnormal
    edges = torch.tensor([0.0, -0.0, top, top * 1.02, top * 1.07, top * 1.2, 3e38, tiny, tiny * (1 - 2.0**-mant / 2),
                          unit, unit / 2, unit / 2 * (1 + 2**-20), unit * 1.5, unit * 2.5, unit / 3,
                          1 + 2.0 ** -(mant + 1), 1 + 3 * 2.0 ** -(mant + 1), 1 + 2.0 ** -(mant + 1) + 2**-20])  # fmt: skip
    spread = torch.randn(1 << 14, generator=gen) * torch.exp(torch.randn(1 << 14, generator=gen) * 4)
    x = torch.cat([patterns[torch.isfinite(patterns)], edges, -edges, spread])
    x = x[: x.numel() // 8 * 8].view(-1, 1, 8)
    ours = torch.zeros(x.shape[0], 1, 1, 8, dtype=kv_dtype)
    theirs = torch.zeros_like(ours)
    slots = torch.arange(x.shape[0])
    cpu_kernels.write_kv(x, x, ours, ours.clone(), slots)
    torch_ref.write_kv(x, x, theirs, theirs.clone(), slots)
    expected = x.clamp(-top, top).to(kv_dtype).view(torch.uint8).flatten()
    assert torch.equal(theirs.view(torch.uint8).flatten(), expected)
    mismatched = (ours.view(torch.uint8).flatten() != expected).nonzero().flatten()
    assert mismatched.numel() == 0, x.flatten()[mismatched[:8]].tolist()
    assert torch.isfinite(ours.float()).all()
