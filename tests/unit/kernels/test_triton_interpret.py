"""Triton kernels against the torch reference, on CPU through the Triton interpreter.

The interpreter is chosen when ``triton.jit`` decorates the kernels (and triton
reads the variable again at launch), so on a machine without CUDA this module
sets TRITON_INTERPRET=1 for the process before ``shared.kernels.triton_attention``
is imported. Where the kernels were already built for a GPU, the same tests run
on CUDA; where they were built without the interpreter and there is no GPU, the
module is skipped.
"""

from __future__ import annotations

import os
import sys

import pytest
import torch

from shared.kernels import torch_ref
from tests.helpers.paged import SeqChunk, build_metadata

_MODULE = "shared.kernels.triton_attention"
if _MODULE not in sys.modules and not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
triton_attention = pytest.importorskip(_MODULE)

if triton_attention.INTERPRETED:
    DEVICE = "cpu"
elif torch.cuda.is_available():
    DEVICE = "cuda"
else:
    pytest.skip("triton kernels were imported without TRITON_INTERPRET=1 and there is no GPU", allow_module_level=True)

LAYER = 1  # a middle layer of three, so the cache views are strided


def make_case(q_lens, seq_lens, block_size, num_kv_heads, group, head_dim=32, dtype=torch.float32, seed=0):
    """Random block-major cache with scattered block tables, new K/V and queries for one step."""
    gen = torch.Generator().manual_seed(seed)
    blocks_per_seq = [-(-s // block_size) for s in seq_lens]
    num_blocks = sum(blocks_per_seq) + 3
    ids = torch.randperm(num_blocks, generator=gen).tolist()
    tables = [ids[sum(blocks_per_seq[:i]) : sum(blocks_per_seq[: i + 1])] for i in range(len(seq_lens))]
    chunks = [SeqChunk(t, s - q, q) for t, q, s in zip(tables, q_lens, seq_lens, strict=True)]
    meta, _ = build_metadata(chunks, block_size)
    meta.slot_mapping, meta.query_start_loc = meta.slot_mapping.to(DEVICE), meta.query_start_loc.to(DEVICE)
    meta.seq_lens, meta.block_tables = meta.seq_lens.to(DEVICE), meta.block_tables.to(DEVICE)
    num_tokens = sum(q_lens)

    def randn(*shape):
        return torch.randn(*shape, generator=gen).to(dtype=dtype, device=DEVICE)

    kv_cache = randn(num_blocks, 3, 2, block_size, num_kv_heads, head_dim)  # block-major, 3 layers
    new_kv = randn(2, num_tokens, num_kv_heads, head_dim)
    query = randn(num_tokens, num_kv_heads * group, head_dim)
    return kv_cache, new_kv[0], new_kv[1], query, meta


def run_both(case, scale=0.3, prefill_kwargs=None, **decode_kwargs):
    """Write K/V and attend with both backends; return (triton_out, reference_out in fp32)."""
    kv_cache, key, value, query, meta = case
    ref_cache = kv_cache.clone()
    torch_ref.write_kv(key, value, ref_cache[:, LAYER, 0], ref_cache[:, LAYER, 1], meta.slot_mapping)
    triton_attention.write_kv(key, value, kv_cache[:, LAYER, 0], kv_cache[:, LAYER, 1], meta.slot_mapping)
    assert torch.equal(kv_cache, ref_cache)  # right slots, other layers untouched
    k_cache, v_cache = kv_cache[:, LAYER, 0], kv_cache[:, LAYER, 1]
    if prefill_kwargs:
        out = triton_attention.paged_prefill(query, k_cache, v_cache, meta, scale, **prefill_kwargs)
    elif decode_kwargs:
        out = triton_attention.paged_decode(query, k_cache, v_cache, meta, scale, **decode_kwargs)
    else:
        out = triton_attention.TritonAttentionBackend().forward(query, k_cache, v_cache, meta, scale)
    ref = torch_ref.paged_attention(query.float(), k_cache.float(), v_cache.float(), meta, scale)
    return out, ref


def assert_matches(out, ref, dtype):
    assert out.dtype == dtype and out.shape == ref.shape
    err = (out.float() - ref).abs().max().item()
    if dtype == torch.float32:
        assert err <= 1e-4, err
    else:
        assert err <= 5e-3 * ref.abs().max().item(), err


@pytest.mark.parametrize("block_size", [4, 16])
@pytest.mark.parametrize("group", [1, 2])
def test_decode(block_size, group):
    # 16 is a multiple of both block sizes, 5 and 33 are not.
    case = make_case([1, 1, 1], [5, 16, 33], block_size, num_kv_heads=2, group=group, seed=block_size + group)
    assert_matches(*run_both(case), torch.float32)


@pytest.mark.parametrize("group", [1, 2])
def test_decode_split_context(group):
    # 16-token partitions: 1, 1 and 3 partitions, merged by the reduce kernel.
    case = make_case([1, 1, 1], [5, 16, 33], 4, num_kv_heads=2, group=group, seed=7)
    assert_matches(*run_both(case, partition_size=16, num_splits=3), torch.float32)


@pytest.mark.parametrize("block_size", [4, 16])
@pytest.mark.parametrize("group", [1, 2])
def test_chunked_prefill_with_cached_prefix(block_size, group):
    # A fresh prompt, a chunk after a cached prefix, and a chunk longer than one query tile.
    case = make_case([6, 7, 20], [6, 16, 37], block_size, num_kv_heads=2, group=group, seed=3 * block_size + group)
    assert_matches(*run_both(case), torch.float32)


@pytest.mark.parametrize("group", [2, 3])
def test_prefill_several_query_tiles(group):
    # 16-token query tiles and context tiles: 37 new tokens span three query tiles.
    case = make_case([37, 1, 9], [45, 4, 9], 4, num_kv_heads=2, group=group, seed=13)
    assert_matches(*run_both(case, prefill_kwargs={"block_m": 16, "block_n": 16}), torch.float32)


@pytest.mark.parametrize("group", [1, 2, 3])
def test_mixed_batch(group):
    # Decode rows (q_len 1) next to prefill chunks go through the prefill kernel.
    case = make_case([1, 5, 1, 3], [9, 12, 16, 3], 4, num_kv_heads=2, group=group, seed=11)
    assert_matches(*run_both(case), torch.float32)


@pytest.mark.parametrize("q_lens", [[1, 1, 1], [1, 6, 2]])
def test_bf16(q_lens):
    case = make_case(q_lens, [5, 16, 33], 4, num_kv_heads=2, group=2, dtype=torch.bfloat16, seed=5)
    assert_matches(*run_both(case), torch.bfloat16)


def test_bf16_split_decode():
    case = make_case([1, 1], [40, 17], 16, num_kv_heads=1, group=2, dtype=torch.bfloat16, seed=6)
    assert_matches(*run_both(case, partition_size=16, num_splits=3), torch.bfloat16)


def test_negative_slots_are_skipped():
    kv_cache, key, value, _, meta = make_case([3], [3], 4, num_kv_heads=2, group=1)
    before = kv_cache.clone()
    slots = torch.tensor([-1, -1, -1], device=DEVICE)
    triton_attention.write_kv(key, value, kv_cache[:, LAYER, 0], kv_cache[:, LAYER, 1], slots)
    assert torch.equal(kv_cache, before)


def test_unsupported_head_dim_is_refused():
    kv_cache, _, _, query, meta = make_case([1], [3], 4, num_kv_heads=1, group=1)
    query = torch.zeros(1, 1, 48, device=DEVICE)
    k_cache = torch.zeros(2, 4, 1, 48, device=DEVICE)
    with pytest.raises(ValueError, match="head_dim"):
        triton_attention.TritonAttentionBackend().forward(query, k_cache, k_cache, meta, 1.0)
