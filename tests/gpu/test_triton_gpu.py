"""Triton attention kernels on CUDA at realistic shapes, against the torch reference in fp32."""

from __future__ import annotations

import pytest
import torch

from shared.kernels import torch_ref
from tests.helpers.paged import SeqChunk, build_metadata

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

BLOCK_SIZE = 16
NUM_KV_HEADS = 8


@pytest.fixture(scope="module")
def ta():
    # Imported here, not at collection, so that the interpreter tests can still choose TRITON_INTERPRET.
    module = pytest.importorskip("shared.kernels.triton_attention")
    if module.INTERPRETED:
        pytest.skip("TRITON_INTERPRET=1 is set; these tests need compiled kernels")
    return module


def make_case(q_lens, seq_lens, group, head_dim, dtype=torch.bfloat16, seed=0):
    gen = torch.Generator().manual_seed(seed)
    blocks_per_seq = [-(-s // BLOCK_SIZE) for s in seq_lens]
    num_blocks = sum(blocks_per_seq) + 7
    ids = torch.randperm(num_blocks, generator=gen).tolist()
    tables = [ids[sum(blocks_per_seq[:i]) : sum(blocks_per_seq[: i + 1])] for i in range(len(seq_lens))]
    meta, _ = build_metadata(
        [SeqChunk(t, s - q, q) for t, q, s in zip(tables, q_lens, seq_lens, strict=True)], BLOCK_SIZE
    )
    for name in ("slot_mapping", "query_start_loc", "seq_lens", "block_tables"):
        setattr(meta, name, getattr(meta, name).cuda())
    num_tokens = sum(q_lens)
    # [num_blocks, num_layers=2, 2, block_size, num_kv_heads, head_dim]; layer 1 views are strided
    kv_cache = torch.randn(num_blocks, 2, 2, BLOCK_SIZE, NUM_KV_HEADS, head_dim, device="cuda").to(dtype)
    new_kv = torch.randn(2, num_tokens, NUM_KV_HEADS, head_dim, device="cuda").to(dtype)
    query = torch.randn(num_tokens, NUM_KV_HEADS * group, head_dim, device="cuda").to(dtype)
    return kv_cache, new_kv[0], new_kv[1], query, meta


def write_both(ta, kv_cache, key, value, meta):
    ref_cache = kv_cache.clone()
    torch_ref.write_kv(key, value, ref_cache[:, 1, 0], ref_cache[:, 1, 1], meta.slot_mapping)
    ta.write_kv(key, value, kv_cache[:, 1, 0], kv_cache[:, 1, 1], meta.slot_mapping)
    torch.cuda.synchronize()
    assert torch.equal(kv_cache, ref_cache)
    return kv_cache[:, 1, 0], kv_cache[:, 1, 1]


def reference(query, k_cache, v_cache, meta, scale):
    return torch_ref.paged_attention(query.float(), k_cache.float(), v_cache.float(), meta, scale)


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("group", [1, 4])
def test_decode_64_seqs(ta, head_dim, group):
    seq_lens = torch.randint(1, 2049, (64,), generator=torch.Generator().manual_seed(head_dim + group)).tolist()
    seq_lens[:3] = [1, 16, 2048]
    kv_cache, key, value, query, meta = make_case([1] * 64, seq_lens, group, head_dim, seed=group)
    k_cache, v_cache = write_both(ta, kv_cache, key, value, meta)
    scale = head_dim**-0.5
    ref = reference(query, k_cache, v_cache, meta, scale)
    out = ta.TritonAttentionBackend().forward(query, k_cache, v_cache, meta, scale)
    torch.testing.assert_close(out.float(), ref, atol=5e-3, rtol=5e-3)
    split = ta.paged_decode(query, k_cache, v_cache, meta, scale, num_splits=4)  # 512-token partitions
    torch.testing.assert_close(split.float(), ref, atol=5e-3, rtol=5e-3)


def test_decode_small_batch_splits_by_itself(ta):
    kv_cache, key, value, query, meta = make_case([1] * 4, [2000, 700, 1, 1500], 4, 128, seed=1)
    assert ta.choose_num_splits(4, NUM_KV_HEADS, meta.max_seq_len, ta.DEFAULT_PARTITION_SIZE, 132) == 4
    k_cache, v_cache = write_both(ta, kv_cache, key, value, meta)
    out = ta.TritonAttentionBackend().forward(query, k_cache, v_cache, meta, 0.1)
    torch.testing.assert_close(out.float(), reference(query, k_cache, v_cache, meta, 0.1), atol=5e-3, rtol=5e-3)


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
def test_chunked_prefill_mixed_batch(ta, head_dim, dtype):
    q_lens = [300, 1, 77, 1, 512, 16]
    seq_lens = [1500, 900, 77, 2048, 1024, 33]
    kv_cache, key, value, query, meta = make_case(q_lens, seq_lens, 4, head_dim, dtype=dtype, seed=2)
    k_cache, v_cache = write_both(ta, kv_cache, key, value, meta)
    out = ta.TritonAttentionBackend().forward(query, k_cache, v_cache, meta, head_dim**-0.5)
    ref = reference(query, k_cache, v_cache, meta, head_dim**-0.5)
    tol = 1e-4 if dtype == torch.float32 else 5e-3
    torch.testing.assert_close(out.float(), ref, atol=tol, rtol=tol)


def test_decode_replays_in_a_cuda_graph(ta):
    kv_cache, key, value, query, meta = make_case([1] * 8, [700] * 8, 4, 64, seed=4)
    k_cache, v_cache = write_both(ta, kv_cache, key, value, meta)
    backend = ta.TritonAttentionBackend()
    backend.forward(query, k_cache, v_cache, meta, 0.125)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = backend.forward(query, k_cache, v_cache, meta, 0.125)
    # New inputs in the captured buffers: other queries, shorter contexts (max_seq_len stays the bound).
    query.copy_(torch.randn_like(query))
    new_lens = [700, 5, 64, 300, 699, 1, 17, 512]
    meta.seq_lens.copy_(torch.tensor(new_lens, dtype=torch.int32))
    meta.seq_lens_cpu = new_lens
    graph.replay()
    torch.testing.assert_close(out.float(), reference(query, k_cache, v_cache, meta, 0.125), atol=5e-3, rtol=5e-3)
