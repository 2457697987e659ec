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


def test_backend_takes_batched_path_only_for_pure_decode(monkeypatch):
    backend = get_attention_backend("cpu")
    assert backend.name == "torch"
    calls = []
    real = torch_ref.paged_decode_batched

    def counting(*args):
        calls.append(1)
        return real(*args)

    monkeypatch.setattr(torch_ref, "paged_decode_batched", counting)
    query, k_cache, v_cache, meta = make_decode_case([9, 12, 3], 4, 2, 2)
    out = backend.forward(query, k_cache, v_cache, meta, 0.5)
    assert calls == [1]
    torch.testing.assert_close(out, torch_ref.paged_attention(query, k_cache, v_cache, meta, 0.5), atol=1e-6, rtol=1e-5)


def test_heavily_padded_batch_uses_per_sequence_path():
    # One long sequence among short ones: padding all to the longest would do > 4x the work.
    _, _, _, meta = make_decode_case([200, 2, 2, 2, 2, 2, 2, 2, 2, 2], 16, 1, 1)
    assert not torch_ref._use_batched_decode(meta)
    _, _, _, meta = make_decode_case([20, 18, 25], 16, 1, 1)
    assert torch_ref._use_batched_decode(meta)


def test_backend_selection():
    assert get_attention_backend("cpu").name == "torch"
    assert get_attention_backend(torch.device("cpu"), "torch").name == "torch"
    with pytest.raises(ValueError, match="unknown attention backend"):
        get_attention_backend("cpu", "flash")
