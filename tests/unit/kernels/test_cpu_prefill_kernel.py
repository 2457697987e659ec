"""The native CPU prefill / chunked-prefill kernel and KV write against the torch reference."""

from __future__ import annotations

import pytest
import torch

from shared.kernels import cpu_kernels, torch_ref
from tests.helpers.paged import SeqChunk, build_metadata

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


@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "block_size,group,head_dim",
    [(16, 3, 64), (16, 1, 32), (8, 4, 16), (32, 2, 64), (4, 5, 8), (16, 6, 128), (64, 1, 192)],
)
def test_prefill_kernel_matches_reference(block_size, group, head_dim, kv_dtype):
    gen = torch.Generator().manual_seed(block_size * 11 + group)
    meta, num_blocks = _mixed_batch(block_size, gen)
    num_kv_heads = 2
    # A bfloat16 cache: the reference reads it widened to float32, exactly what the kernel reads.
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


@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.bfloat16])
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
    assert torch.equal(ours, theirs)
    assert ours[:, 0].abs().sum() == 0  # the other layer is untouched
