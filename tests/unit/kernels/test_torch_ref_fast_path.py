"""The batched pure-decode path of the torch backend against the per-sequence reference."""

from __future__ import annotations

import pytest
import torch

from shared.kernels import get_attention_backend, torch_ref
from tests.helpers.paged import SeqChunk, build_metadata


def make_decode_case(seq_lens, block_size, num_kv_heads, group, head_dim=16, dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    blocks_per_seq = [-(-s // block_size) for s in seq_lens]
    num_blocks = sum(blocks_per_seq) + 2
    ids = torch.randperm(num_blocks, generator=gen).tolist()
    tables = [ids[sum(blocks_per_seq[:i]) : sum(blocks_per_seq[: i + 1])] for i in range(len(seq_lens))]
    meta, _ = build_metadata([SeqChunk(t, s - 1, 1) for t, s in zip(tables, seq_lens, strict=True)], block_size)
    # [num_blocks, num_layers=2, 2, block_size, num_kv_heads, head_dim]; layer 1 gives strided views
    kv_cache = torch.randn(num_blocks, 2, 2, block_size, num_kv_heads, head_dim, generator=gen).to(dtype)
    query = torch.randn(len(seq_lens), num_kv_heads * group, head_dim, generator=gen).to(dtype)
    return query, kv_cache[:, 1, 0], kv_cache[:, 1, 1], meta


@pytest.mark.parametrize("block_size", [4, 16])
@pytest.mark.parametrize("group", [1, 2, 4])
def test_batched_decode_equals_reference(block_size, group):
    query, k_cache, v_cache, meta = make_decode_case([5, 16, 33, 1], block_size, 2, group, seed=block_size + group)
    ref = torch_ref.paged_attention(query, k_cache, v_cache, meta, 0.25)
    fast = torch_ref.paged_decode_batched(query, k_cache, v_cache, meta, 0.25)
    torch.testing.assert_close(fast, ref, atol=1e-6, rtol=1e-5)


def test_batched_decode_bf16_within_rounding():
    query, k_cache, v_cache, meta = make_decode_case([7, 30, 12], 4, 2, 2, dtype=torch.bfloat16, seed=3)
    ref = torch_ref.paged_attention(query.float(), k_cache.float(), v_cache.float(), meta, 0.25)
    fast = torch_ref.paged_decode_batched(query, k_cache, v_cache, meta, 0.25)
    assert fast.dtype == torch.bfloat16
    torch.testing.assert_close(fast.float(), ref, atol=1e-2, rtol=1e-2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fast_path_equals_reference_on_mixed_batches(dtype):
    """Decode rows of very different lengths (several groups), chunked prefill with a
    cached prefix, and a prefill without one, in one batch."""
    gen = torch.Generator().manual_seed(7)
    block_size, num_kv_heads, group, head_dim = 4, 2, 2, 16
    lens = [(200, 1), (2, 1), (3, 1), (2, 1), (17, 5), (9, 9), (40, 1), (41, 1)]  # (seq_len, q_len)
    blocks_per_seq = [-(-s // block_size) for s, _ in lens]
    ids = torch.randperm(sum(blocks_per_seq) + 3, generator=gen).tolist()
    tables = [ids[sum(blocks_per_seq[:i]) : sum(blocks_per_seq[: i + 1])] for i in range(len(lens))]
    chunks = [SeqChunk(t, s - q, q) for t, (s, q) in zip(tables, lens, strict=True)]
    meta, _ = build_metadata(chunks, block_size)
    kv_cache = torch.randn(len(ids), 2, 2, block_size, num_kv_heads, head_dim, generator=gen).to(dtype)
    query = torch.randn(sum(q for _, q in lens), num_kv_heads * group, head_dim, generator=gen).to(dtype)
    k_cache, v_cache = kv_cache[:, 1, 0], kv_cache[:, 1, 1]
    assert len(torch_ref.decode_groups([s for s, q in lens if q == 1])) > 1
    ref = torch_ref.paged_attention(query.float(), k_cache.float(), v_cache.float(), meta, 0.3)
    fast = get_attention_backend("cpu").forward(query, k_cache, v_cache, meta, 0.3)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(fast.float(), ref, atol=tol, rtol=tol)


def test_decode_groups_bound_padding():
    lens = [200, 2, 2, 3, 40, 41, 39]
    groups = torch_ref.decode_groups(lens)
    assert sorted(i for g in groups for i in g) == list(range(len(lens)))
    for g in groups:
        longest = max(lens[i] for i in g)
        assert len(g) == 1 or len(g) * longest <= 1.5 * sum(lens[i] for i in g)


def test_backend_selection():
    assert get_attention_backend("cpu").name == "torch"
    assert get_attention_backend(torch.device("cpu"), "torch").name == "torch"
    with pytest.raises(ValueError, match="unknown attention backend"):
        get_attention_backend("cpu", "flash")
