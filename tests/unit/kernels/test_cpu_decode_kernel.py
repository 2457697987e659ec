"""The native CPU decode kernel against the torch reference."""

from __future__ import annotations

import pytest
import torch

from shared.kernels import cpu_kernels, torch_ref
from tests.helpers.paged import FP8_KV_DTYPES, KV_DTYPES, SeqChunk, build_metadata

pytestmark = pytest.mark.skipif(cpu_kernels.load() is None, reason="no C compiler to build the CPU kernels")


def _decode_batch(seq_lens, block_size, num_kv_heads, group, head_dim, gen, kv_dtype=torch.float32):
    """One decode row per sequence over shuffled blocks; K/V are strided views of a 3-layer cache's last layer
    (of ``kv_dtype``: the reference reads a bfloat16 or float8 cache widened to float32, exactly what the kernel
    reads)."""
    blocks_per_seq = [-(-s // block_size) for s in seq_lens]
    ids = torch.randperm(sum(blocks_per_seq) + 4, generator=gen).tolist()
    tables = [ids[sum(blocks_per_seq[:i]) : sum(blocks_per_seq[: i + 1])] for i in range(len(seq_lens))]
    meta, _ = build_metadata([SeqChunk(t, s - 1, 1) for t, s in zip(tables, seq_lens, strict=True)], block_size)
    kv_cache = torch.randn(len(ids), 3, 2, block_size, num_kv_heads, head_dim, generator=gen).to(kv_dtype)
    query = torch.randn(len(seq_lens), num_kv_heads * group, head_dim, generator=gen)
    return meta, kv_cache[:, 2, 0], kv_cache[:, 2, 1], query


# Vector paths: head_dim % 16 (scores), % 64 (weighted values), blocks over 16 keys, groups over 4 heads;
# each over every cache dtype the kernels are built for.
@pytest.mark.parametrize("kv_dtype", KV_DTYPES)
@pytest.mark.parametrize(
    "block_size,group,head_dim",
    [(4, 1, 16), (16, 2, 32), (16, 4, 64), (8, 3, 32), (16, 3, 64), (32, 6, 128), (8, 5, 24), (64, 1, 192)],
)
def test_decode_kernel_matches_reference(block_size, group, head_dim, kv_dtype):
    gen = torch.Generator().manual_seed(block_size * 7 + group)
    seq_lens = [1, 5, block_size, 3 * block_size + 1, 97, 40]
    meta, k_cache, v_cache, query = _decode_batch(seq_lens, block_size, 2, group, head_dim, gen, kv_dtype)
    assert cpu_kernels.supports(query, k_cache, v_cache)
    ref = torch_ref.paged_attention(query, k_cache, v_cache, meta, 0.3)
    out = cpu_kernels.paged_decode(query, k_cache, v_cache, meta.block_tables, meta.seq_lens_cpu, 0.3)
    assert out is not None
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=1e-4)
    # And through the backend, which routes decode rows of any batch to the kernel.
    torch.testing.assert_close(
        torch_ref.paged_attention_fast(query, k_cache, v_cache, meta, 0.3), ref, atol=2e-5, rtol=1e-4
    )


def test_kernel_declines_unsupported_shapes():
    query = torch.randn(1, 40, 16)  # a GQA group of 20 exceeds the kernel's limit
    kv_cache = torch.randn(2, 1, 2, 4, 2, 16)
    meta, _ = build_metadata([SeqChunk([0], 2, 1)], 4)
    assert cpu_kernels.paged_decode(query, kv_cache[:, 0, 0], kv_cache[:, 0, 1], meta.block_tables, [3], 0.3) is None
    ref = torch_ref.paged_attention(query, kv_cache[:, 0, 0], kv_cache[:, 0, 1], meta, 0.3)
    fast = torch_ref.paged_attention_fast(query, kv_cache[:, 0, 0], kv_cache[:, 0, 1], meta, 0.3)
    torch.testing.assert_close(fast, ref, atol=1e-5, rtol=1e-5)


# Eight or more sequences: each item takes every KV head of a sequence (one contiguous read per cache row).
@pytest.mark.parametrize("kv_dtype", KV_DTYPES)
@pytest.mark.parametrize("block_size,group,head_dim", [(16, 3, 64), (8, 5, 24), (4, 2, 20)])
def test_decode_rows_do_not_depend_on_the_batch(block_size, group, head_dim, kv_dtype):
    gen = torch.Generator().manual_seed(block_size * 13 + head_dim)
    seq_lens = [1, 7, block_size, 2 * block_size + 3, 97, 40, 33, 5, 64, 12]
    meta, k_cache, v_cache, query = _decode_batch(seq_lens, block_size, 3, group, head_dim, gen, kv_dtype)
    whole = cpu_kernels.paged_decode(query, k_cache, v_cache, meta.block_tables, meta.seq_lens_cpu, 0.3)
    assert whole is not None
    ref = torch_ref.paged_attention(query, k_cache, v_cache, meta, 0.3)
    torch.testing.assert_close(whole, ref, atol=2e-5, rtol=1e-4)
    for i in (0, 3, 4):  # alone, a sequence takes the one-head items: the same values, bit for bit
        alone = cpu_kernels.paged_decode(query[i : i + 1], k_cache, v_cache, meta.block_tables[i : i + 1],
                                         meta.seq_lens_cpu[i : i + 1], 0.3)  # fmt: skip
        assert alone is not None and torch.equal(alone[0], whole[i])
    # The prefill kernel's single-token rows (decode rows of a mixed step) agree too.
    starts = torch.arange(len(seq_lens) + 1, dtype=torch.int32)
    mixed = cpu_kernels.paged_prefill(query, k_cache, v_cache, meta.block_tables, starts,
                                      torch.tensor(seq_lens, dtype=torch.int32), 0.3)  # fmt: skip
    assert mixed is not None and torch.equal(mixed, whole)


@pytest.mark.parametrize("head_dim", [64, 8])  # the vector path, and the scalar one (a table of the 256 codes)
@pytest.mark.parametrize("kv_dtype", FP8_KV_DTYPES)
def test_every_float8_code_widens_exactly(kv_dtype, head_dim):
    """A context of one token attends to it alone (weight exactly 1): the output is its value row widened, which
    for every finite code must be torch's own widening, bit for bit (subnormals and both signs included)."""
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    codes = codes[torch.isfinite(codes.view(kv_dtype).float())]
    codes = torch.cat([codes, codes[: (-codes.numel()) % head_dim]])  # whole rows
    rows = codes.view(-1, head_dim)  # one sequence per row of codes, one block each
    num_seqs = rows.shape[0]
    kv_cache = torch.zeros(num_seqs, 1, 2, 4, 1, head_dim, dtype=torch.uint8)
    kv_cache[:, 0, 1, 0, 0] = rows  # each block's first value row
    kv_cache = kv_cache.view(kv_dtype)
    meta, _ = build_metadata([SeqChunk([i], 0, 1) for i in range(num_seqs)], 4)
    query = torch.randn(num_seqs, 2, head_dim, generator=torch.Generator().manual_seed(0))
    out = cpu_kernels.paged_decode(query, kv_cache[:, 0, 0], kv_cache[:, 0, 1], meta.block_tables, [1] * num_seqs, 0.3)
    assert out is not None
    expected = rows.view(kv_dtype).float()  # [num_seqs, head_dim]
    assert torch.equal(out[:, 0], expected) and torch.equal(out[:, 1], expected)
