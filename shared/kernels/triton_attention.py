"""Triton attention kernels over the paged KV cache (the CUDA backend).

All kernels read the cache through strides, so a layer view ``kv_cache[:, layer, 0]``
of the block-major cache works as is (layout and causality: ``shared.kernels.metadata``).

- ``_write_kv_kernel``: new K/V rows -> their cache slots.
- ``_decode_kernel``: one query token per sequence. A program owns one (sequence,
  KV head, context partition) and all query heads of that KV head, so each K/V
  tile is loaded once per group. Long contexts on small batches are split into
  partitions whose softmax states ``_decode_reduce_kernel`` merges.
- ``_prefill_kernel``: each sequence's new tokens attend causally to its cached
  prefix and to themselves, variable lengths in one launch. ``write_kv`` has
  already stored the new tokens' K/V, so everything is read from the cache.

Softmax is online, in fp32 and base 2 (scores carry ``scale * log2(e)``). Grids
use only host ints from the metadata, so ``forward`` never syncs with the device.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from shared.kernels.metadata import AttentionMetadata

_LOG2E = 1.4426950408889634
DEFAULT_PARTITION_SIZE = 512  # context tokens per decode program when splitting


# fmt: off
@triton.jit
def _write_kv_kernel(
    key_ptr, value_ptr,  # [num_tokens, num_kv_heads, head_dim] each
    k_cache_ptr, v_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim] each, strided
    slot_mapping_ptr,  # [num_tokens] int64; a negative slot (padding token) is skipped
    stride_kt, stride_kh, stride_kd, stride_vt, stride_vh, stride_vd,  # key, value strides
    stride_cb, stride_cs, stride_ch, stride_cd,  # k_cache strides (v_cache has the same)
    num_kv_heads, block_size,  # ints
    HEAD_DIM: tl.constexpr, HEADS_P2: tl.constexpr,  # HEADS_P2: power of two >= num_kv_heads
):
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if slot < 0:
        return
    heads = tl.arange(0, HEADS_P2)[:, None]  # [HEADS_P2, 1]
    dims = tl.arange(0, HEAD_DIM)[None, :]  # [1, HEAD_DIM]
    mask = heads < num_kv_heads
    key = tl.load(key_ptr + token * stride_kt + heads * stride_kh + dims * stride_kd, mask=mask)
    value = tl.load(value_ptr + token * stride_vt + heads * stride_vh + dims * stride_vd, mask=mask)
    dst = (slot // block_size) * stride_cb + (slot % block_size) * stride_cs + heads * stride_ch + dims * stride_cd
    tl.store(k_cache_ptr + dst, key.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(v_cache_ptr + dst, value.to(v_cache_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _attend_tile(
    q,  # [ROWS, HEAD_DIM] in the dot dtype
    acc, m_i, l_i,  # [ROWS, HEAD_DIM], [ROWS], [ROWS] fp32: unnormalised output, running max, running sum
    allowed,  # [ROWS, BLOCK_N] bool: which (row, position) pairs may attend
    k_cache_ptr, v_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim] each, strided
    block_table_ptr,  # [max_blocks_per_seq] int32: this sequence's row
    positions, in_range,  # [BLOCK_N] int32, [BLOCK_N] bool: context positions of the tile, which exist
    kv_head, block_size, scale_log2,
    stride_cb, stride_cs, stride_ch, stride_cd,  # cache strides
    HEAD_DIM: tl.constexpr, DOT_FP32: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    """One online-softmax step over a tile of context positions."""
    # int64: block id times the block stride of a large cache overflows int32.
    block_ids = tl.load(block_table_ptr + positions // block_size, mask=in_range, other=0).to(tl.int64)
    offs = (block_ids * stride_cb + (positions % block_size) * stride_cs)[:, None] + kv_head * stride_ch
    offs += tl.arange(0, HEAD_DIM)[None, :] * stride_cd  # [BLOCK_N, HEAD_DIM]
    k = tl.load(k_cache_ptr + offs, mask=in_range[:, None], other=0.0).to(q.dtype)
    v = tl.load(v_cache_ptr + offs, mask=in_range[:, None], other=0.0).to(q.dtype)
    scores = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale_log2  # [ROWS, BLOCK_N]
    scores = tl.where(allowed, scores, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(scores, 1))  # [ROWS]
    alpha = tl.exp2(m_i - m_new)  # [ROWS]
    p = tl.exp2(scores - m_new[:, None])  # [ROWS, BLOCK_N]
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
    return acc, m_new, l_i


@triton.jit
def _decode_kernel(
    out_ptr,  # [num_seqs, num_heads, head_dim], written when not USE_SPLITS
    part_acc_ptr,  # [num_seqs, num_heads, num_splits, head_dim] fp32, written when USE_SPLITS
    part_max_ptr, part_sum_ptr,  # [num_seqs, num_heads, num_splits] fp32 each, written when USE_SPLITS
    query_ptr,  # [num_seqs, num_heads, head_dim]
    k_cache_ptr, v_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim] each, strided
    block_tables_ptr,  # [num_seqs, max_blocks_per_seq] int32
    seq_lens_ptr,  # [num_seqs] int32
    scale_log2,  # float: softmax scale * log2(e)
    stride_qt, stride_qh, stride_qd, stride_ot, stride_oh, stride_od,  # query, out strides
    stride_cb, stride_cs, stride_ch, stride_cd,  # cache strides
    stride_bt,  # block_tables row stride
    block_size, num_heads, num_splits,  # ints
    GROUP: tl.constexpr,  # query heads per KV head
    GROUP_P2: tl.constexpr,  # rows per program: power of two >= GROUP and >= 16 for tl.dot
    HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr,  # BLOCK_N: context positions per tile
    PARTITION_SIZE: tl.constexpr,  # context positions per split, a multiple of BLOCK_N
    USE_SPLITS: tl.constexpr, DOT_FP32: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    seq, kv_head, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + seq)
    if USE_SPLITS:
        ctx_start = split * PARTITION_SIZE
        ctx_end = tl.minimum(ctx_start + PARTITION_SIZE, seq_len)
    else:
        ctx_start = 0
        ctx_end = seq_len
    if ctx_start >= ctx_end:
        return  # partition past this sequence's end; the reduce kernel skips it

    group_rows = tl.arange(0, GROUP_P2)  # [GROUP_P2]
    heads = kv_head * GROUP + group_rows  # [GROUP_P2]
    row_valid = group_rows < GROUP
    dims = tl.arange(0, HEAD_DIM)
    q_off = seq * stride_qt + heads[:, None] * stride_qh + dims[None, :] * stride_qd
    q = tl.load(query_ptr + q_off, mask=row_valid[:, None], other=0.0)  # [GROUP_P2, HEAD_DIM]
    q = q.to(tl.float32) if DOT_FP32 else q
    acc = tl.zeros([GROUP_P2, HEAD_DIM], dtype=tl.float32)
    m_i = tl.full([GROUP_P2], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([GROUP_P2], dtype=tl.float32)
    block_table_ptr = block_tables_ptr + seq.to(tl.int64) * stride_bt
    for tile_start in range(ctx_start, ctx_end, BLOCK_N):
        positions = tile_start + tl.arange(0, BLOCK_N)  # [BLOCK_N]
        in_range = positions < ctx_end
        acc, m_i, l_i = _attend_tile(
            q, acc, m_i, l_i, in_range[None, :], k_cache_ptr, v_cache_ptr, block_table_ptr, positions, in_range,
            kv_head, block_size, scale_log2, stride_cb, stride_cs, stride_ch, stride_cd,
            HEAD_DIM, DOT_FP32, DOT_PRECISION,
        )

    if USE_SPLITS:
        part_rows = (seq * num_heads + heads) * num_splits + split  # [GROUP_P2]
        tl.store(part_max_ptr + part_rows, m_i, mask=row_valid)
        tl.store(part_sum_ptr + part_rows, l_i, mask=row_valid)
        tl.store(part_acc_ptr + part_rows[:, None] * HEAD_DIM + dims[None, :], acc, mask=row_valid[:, None])
    else:
        out_off = seq * stride_ot + heads[:, None] * stride_oh + dims[None, :] * stride_od
        tl.store(out_ptr + out_off, (acc / l_i[:, None]).to(out_ptr.dtype.element_ty), mask=row_valid[:, None])


@triton.jit
def _decode_reduce_kernel(
    out_ptr,  # [num_seqs, num_heads, head_dim]
    part_acc_ptr,  # [num_seqs, num_heads, num_splits, head_dim] fp32
    part_max_ptr, part_sum_ptr,  # [num_seqs, num_heads, num_splits] fp32 each
    seq_lens_ptr,  # [num_seqs] int32
    stride_ot, stride_oh, stride_od,  # out strides
    num_heads, num_splits,  # ints
    HEAD_DIM: tl.constexpr, PARTITION_SIZE: tl.constexpr,
    SPLITS_P2: tl.constexpr,  # power of two >= num_splits
):
    """Merge the partial softmax states of one (sequence, query head)."""
    seq, head = tl.program_id(0), tl.program_id(1)
    splits = tl.arange(0, SPLITS_P2)  # [SPLITS_P2]
    used = splits < tl.cdiv(tl.load(seq_lens_ptr + seq), PARTITION_SIZE)
    rows = (seq * num_heads + head) * num_splits + splits  # [SPLITS_P2]
    part_max = tl.load(part_max_ptr + rows, mask=used, other=float("-inf"))
    part_sum = tl.load(part_sum_ptr + rows, mask=used, other=0.0)
    dims = tl.arange(0, HEAD_DIM)
    part_acc = tl.load(part_acc_ptr + rows[:, None] * HEAD_DIM + dims[None, :], mask=used[:, None], other=0.0)
    weight = tl.exp2(part_max - tl.max(part_max, 0))  # [SPLITS_P2]
    out = tl.sum(part_acc * weight[:, None], 0) / tl.sum(part_sum * weight, 0)  # [HEAD_DIM]
    tl.store(out_ptr + seq * stride_ot + head * stride_oh + dims * stride_od, out.to(out_ptr.dtype.element_ty))


@triton.jit
def _prefill_kernel(
    out_ptr, query_ptr,  # [num_tokens, num_heads, head_dim] each
    k_cache_ptr, v_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim] each, strided
    block_tables_ptr,  # [num_seqs, max_blocks_per_seq] int32
    seq_lens_ptr,  # [num_seqs] int32
    query_start_loc_ptr,  # [num_seqs + 1] int32
    scale_log2,  # float: softmax scale * log2(e)
    stride_qt, stride_qh, stride_qd, stride_ot, stride_oh, stride_od,  # query, out strides
    stride_cb, stride_cs, stride_ch, stride_cd,  # cache strides
    stride_bt,  # block_tables row stride
    block_size,  # int
    GROUP: tl.constexpr, GROUP_P2: tl.constexpr,  # query heads per KV head, its next power of two
    HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr,  # query tokens per program: BLOCK_M * GROUP_P2 rows
    BLOCK_N: tl.constexpr,  # context positions per tile
    DOT_FP32: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    seq, q_tile, kv_head = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    if q_tile * BLOCK_M >= q_len:
        return
    num_cached = tl.load(seq_lens_ptr + seq) - q_len  # context tokens before this step's tokens

    # Row r is new token q_tile * BLOCK_M + r // GROUP_P2, query head r % GROUP_P2 of the group.
    rows = tl.arange(0, BLOCK_M * GROUP_P2)  # [ROWS]
    tokens = q_tile * BLOCK_M + rows // GROUP_P2  # [ROWS]
    heads = kv_head * GROUP + rows % GROUP_P2  # [ROWS]
    row_valid = (tokens < q_len) & (rows % GROUP_P2 < GROUP)
    dims = tl.arange(0, HEAD_DIM)
    token_ids = (q_start + tokens).to(tl.int64)[:, None]  # [ROWS, 1]
    q_off = token_ids * stride_qt + heads[:, None] * stride_qh + dims[None, :] * stride_qd
    q = tl.load(query_ptr + q_off, mask=row_valid[:, None], other=0.0)  # [ROWS, HEAD_DIM]
    q = q.to(tl.float32) if DOT_FP32 else q
    q_positions = num_cached + tokens  # [ROWS]: absolute position of each row's token

    acc = tl.zeros([BLOCK_M * GROUP_P2, HEAD_DIM], dtype=tl.float32)
    m_i = tl.full([BLOCK_M * GROUP_P2], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M * GROUP_P2], dtype=tl.float32)
    block_table_ptr = block_tables_ptr + seq.to(tl.int64) * stride_bt
    # The tile's last token sees the most context; no position after it is needed.
    ctx_end = num_cached + tl.minimum((q_tile + 1) * BLOCK_M, q_len)
    for tile_start in range(0, ctx_end, BLOCK_N):
        positions = tile_start + tl.arange(0, BLOCK_N)  # [BLOCK_N]
        in_range = positions < ctx_end
        allowed = (positions[None, :] <= q_positions[:, None]) & in_range[None, :]  # [ROWS, BLOCK_N]
        acc, m_i, l_i = _attend_tile(
            q, acc, m_i, l_i, allowed, k_cache_ptr, v_cache_ptr, block_table_ptr, positions, in_range,
            kv_head, block_size, scale_log2, stride_cb, stride_cs, stride_ch, stride_cd,
            HEAD_DIM, DOT_FP32, DOT_PRECISION,
        )

    out_off = token_ids * stride_ot + heads[:, None] * stride_oh + dims[None, :] * stride_od
    tl.store(out_ptr + out_off, (acc / l_i[:, None]).to(out_ptr.dtype.element_ty), mask=row_valid[:, None])
# fmt: on


def _check_shapes(query: torch.Tensor, k_cache: torch.Tensor) -> tuple[int, int]:
    """Return (head_dim, group) or raise with the remedy."""
    head_dim = query.shape[-1]
    if head_dim & (head_dim - 1) or not 16 <= head_dim <= 256:
        raise ValueError(
            f"Triton attention needs a power-of-two head_dim in [16, 256] (32, 64 and 128 are tested); "
            f"got {head_dim}. Use the torch attention backend for this model."
        )
    num_heads, num_kv_heads = query.shape[1], k_cache.shape[2]
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads={num_heads} is not a multiple of num_kv_heads={num_kv_heads}")
    return head_dim, num_heads // num_kv_heads


def _dot_config(dtype: torch.dtype, head_dim: int) -> dict[str, bool | str | int]:
    """Dot precision and warps. fp32 inputs get exact fp32 dots, not tf32, and more
    warps so the tiles fit in registers. The interpreter's dot multiplies bf16 as raw
    integers, so under it every dot runs on fp32 operands."""
    exact = dtype == torch.float32 or INTERPRETED
    num_warps = 8 if head_dim >= 128 or dtype == torch.float32 else 4
    return {"DOT_FP32": exact, "DOT_PRECISION": "ieee" if exact else "tf32", "num_warps": num_warps}


def _strides(*tensors: torch.Tensor) -> list[int]:
    return [stride for tensor in tensors for stride in tensor.stride()]


def _cache_strides(k_cache: torch.Tensor, v_cache: torch.Tensor) -> list[int]:
    """The kernels address K and V with one set of strides, as views of one block-major cache have."""
    if k_cache.stride() != v_cache.stride():
        raise ValueError(f"k_cache strides {k_cache.stride()} differ from v_cache strides {v_cache.stride()}")
    return list(k_cache.stride())


_NUM_SMS: dict[int, int] = {}


def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 128
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _NUM_SMS:
        _NUM_SMS[index] = torch.cuda.get_device_properties(index).multi_processor_count
    return _NUM_SMS[index]


def choose_num_splits(num_seqs: int, num_kv_heads: int, max_seq_len: int, partition_size: int, num_sms: int) -> int:
    """Split the context only when (sequence, KV head) programs cannot fill the GPU."""
    max_splits = triton.cdiv(max_seq_len, partition_size)
    if max_splits <= 1 or num_seqs * num_kv_heads >= 2 * num_sms:
        return 1
    return max_splits


def paged_decode(
    query: torch.Tensor,  # [num_seqs, num_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    meta: AttentionMetadata,
    scale: float,
    partition_size: int = DEFAULT_PARTITION_SIZE,
    num_splits: int | None = None,
) -> torch.Tensor:  # [num_seqs, num_heads, head_dim]
    """Attention of one new token per sequence; ``num_splits=None`` splits only when occupancy is low."""
    head_dim, group = _check_shapes(query, k_cache)
    (num_seqs, num_heads, _), num_kv_heads = query.shape, k_cache.shape[2]
    block_n = min(64, partition_size)
    assert partition_size % block_n == 0, f"partition_size {partition_size} must be a multiple of 64 or below it"
    if num_splits is None:
        num_splits = choose_num_splits(num_seqs, num_kv_heads, meta.max_seq_len, partition_size, _num_sms(query.device))
    out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
    if num_seqs == 0:
        return out
    use_splits = num_splits > 1
    part_shape = (num_seqs, num_heads, num_splits) if use_splits else (1, 1, 1)
    part_acc = torch.empty((*part_shape, head_dim), dtype=torch.float32, device=query.device)
    part_max = torch.empty(part_shape, dtype=torch.float32, device=query.device)
    part_sum = torch.empty(part_shape, dtype=torch.float32, device=query.device)
    tensors = (out, part_acc, part_max, part_sum, query, k_cache, v_cache, meta.block_tables, meta.seq_lens)
    strides = _strides(query, out) + _cache_strides(k_cache, v_cache) + [meta.block_tables.stride(0)]
    consts = {"GROUP": group, "GROUP_P2": max(16, triton.next_power_of_2(group)), "HEAD_DIM": head_dim}
    consts |= {"BLOCK_N": block_n, "PARTITION_SIZE": partition_size, "USE_SPLITS": use_splits}
    consts |= _dot_config(query.dtype, head_dim)
    ints = (k_cache.shape[1], num_heads, num_splits)
    _decode_kernel[(num_seqs, num_kv_heads, num_splits)](*tensors, scale * _LOG2E, *strides, *ints, **consts)
    if use_splits:
        partials = (out, part_acc, part_max, part_sum, meta.seq_lens)
        splits_p2 = triton.next_power_of_2(num_splits)
        consts = {"HEAD_DIM": head_dim, "PARTITION_SIZE": partition_size, "SPLITS_P2": splits_p2}
        _decode_reduce_kernel[(num_seqs, num_heads)](*partials, *out.stride(), num_heads, num_splits, **consts)
    return out


def paged_prefill(
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    meta: AttentionMetadata,
    scale: float,
    block_m: int | None = None,
    block_n: int | None = None,
) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
    """Causal attention of every sequence's new tokens over cached prefix + themselves (any q_len)."""
    head_dim, group = _check_shapes(query, k_cache)
    group_p2 = triton.next_power_of_2(group)
    if block_m is None:
        block_m = max(16, 64 // group_p2)  # aim at 64 rows per program
    if block_n is None:
        block_n = 32 if query.dtype == torch.float32 else 64  # fp32 tiles spill registers at 64
    out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
    if meta.num_seqs == 0:
        return out
    tensors = (out, query, k_cache, v_cache, meta.block_tables, meta.seq_lens, meta.query_start_loc)
    strides = _strides(query, out) + _cache_strides(k_cache, v_cache) + [meta.block_tables.stride(0)]
    consts = {"GROUP": group, "GROUP_P2": group_p2, "HEAD_DIM": head_dim, "BLOCK_M": block_m, "BLOCK_N": block_n}
    grid = (meta.num_seqs, triton.cdiv(meta.max_query_len, block_m), k_cache.shape[2])
    _prefill_kernel[grid](
        *tensors, scale * _LOG2E, *strides, k_cache.shape[1], **consts, **_dot_config(query.dtype, head_dim)
    )
    return out


def write_kv(
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim], may be a strided layer view
    v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    slot_mapping: torch.Tensor,  # [num_tokens] int64
) -> None:
    """Store each new token's K/V at its slot; tokens with a negative slot are skipped."""
    num_tokens, num_kv_heads, head_dim = key.shape
    if num_tokens == 0:
        return
    assert head_dim & (head_dim - 1) == 0, f"head_dim must be a power of two, got {head_dim}"
    strides = _strides(key, value) + _cache_strides(k_cache, v_cache)
    consts = {"HEAD_DIM": head_dim, "HEADS_P2": triton.next_power_of_2(num_kv_heads)}
    grid = (num_tokens,)
    _write_kv_kernel[grid](
        key, value, k_cache, v_cache, slot_mapping, *strides, num_kv_heads, k_cache.shape[1], **consts
    )


class TritonAttentionBackend:
    """Attention backend on Triton kernels: ``write_kv`` then ``forward`` per layer.

    Grids come from host ints only (``max_query_len``, ``max_seq_len``), so a
    step can be captured in a CUDA graph: capture with the largest
    ``max_seq_len`` to be replayed, programs past a sequence's end exit early.
    """

    name = "triton"

    def __init__(self, decode_partition_size: int = DEFAULT_PARTITION_SIZE) -> None:
        self.decode_partition_size = decode_partition_size

    def write_kv(self, key, value, k_cache, v_cache, slot_mapping) -> None:
        write_kv(key, value, k_cache, v_cache, slot_mapping)

    def forward(self, query, k_cache, v_cache, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        if meta.is_pure_decode:
            return paged_decode(query, k_cache, v_cache, meta, scale, self.decode_partition_size)
        return paged_prefill(query, k_cache, v_cache, meta, scale)


# Whether the kernels above were built for the Triton interpreter (TRITON_INTERPRET=1 at import).
INTERPRETED = not isinstance(_decode_kernel, triton.runtime.JITFunction)
