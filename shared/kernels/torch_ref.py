"""Torch reference attention over the paged KV cache.

This is the CPU backend and the oracle every faster kernel is tested against.
Layout and causality are described in ``shared.kernels.metadata``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from shared.kernels import cpu_kernels
from shared.kernels.metadata import AttentionMetadata


def write_kv(
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    slot_mapping: torch.Tensor,  # [num_tokens] int64
) -> None:
    """Store each new token's K/V at its slot (block_id * block_size + offset)."""
    num_blocks, block_size = k_cache.shape[:2]
    block_ids = slot_mapping // block_size
    offsets = slot_mapping % block_size
    if k_cache.element_size() == 1:  # float8: saturated at its largest value (e5m2 would round beyond to inf)
        limit = torch.finfo(k_cache.dtype).max
        key, value = key.clamp(-limit, limit), value.clamp(-limit, limit)
    k_cache[block_ids, offsets] = key.to(k_cache.dtype)
    v_cache[block_ids, offsets] = value.to(v_cache.dtype)


def gather_blocks(
    cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim], a layer's strided view
    block_ids: torch.Tensor,  # [n] int64
) -> torch.Tensor:  # [n, block_size, num_kv_heads, head_dim]
    """Copy whole blocks out of the cache.

    A block of one layer is one contiguous run of memory, so the blocks are
    selected as rows of a 2-D view: a memcpy per block instead of an
    element-wise index kernel.
    """
    num_blocks, block_size, num_kv_heads, head_dim = cache.shape
    row = block_size * num_kv_heads * head_dim
    if cache.stride()[1:] != (num_kv_heads * head_dim, head_dim, 1):
        return cache[block_ids]
    rows = cache.as_strided((num_blocks, row), (cache.stride(0), 1))  # [num_blocks, row]
    return rows.index_select(0, block_ids).view(-1, block_size, num_kv_heads, head_dim)


def _gather_context(
    cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    block_table: torch.Tensor,  # [max_blocks] int32
    seq_len: int,
) -> torch.Tensor:
    block_size = cache.shape[1]
    num_blocks = (seq_len + block_size - 1) // block_size
    blocks = gather_blocks(cache, block_table[:num_blocks].long())  # [n, block_size, kv_heads, head_dim]
    return blocks.flatten(0, 1)[:seq_len]  # [seq_len, kv_heads, head_dim]


def causal_mask(q_len: int, seq_len: int) -> torch.Tensor:  # [q_len, seq_len] bool
    """New token j sits at absolute position seq_len - q_len + j and sees positions up to it."""
    q_pos = torch.arange(seq_len - q_len, seq_len).unsqueeze(1)  # [q_len, 1]
    return torch.arange(seq_len).unsqueeze(0) <= q_pos


def paged_attention(
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
    """Causal attention of each sequence's new tokens over its whole paged context."""
    num_heads = query.shape[1]
    num_kv_heads = k_cache.shape[2]
    group = num_heads // num_kv_heads
    out = torch.empty_like(query)
    start = 0
    for i, (q_len, seq_len) in enumerate(zip(meta.query_lens_cpu, meta.seq_lens_cpu, strict=True)):
        q = query[start : start + q_len].transpose(0, 1)  # [num_heads, q_len, head_dim]
        k = _gather_context(k_cache, meta.block_tables[i], seq_len).to(query.dtype)
        v = _gather_context(v_cache, meta.block_tables[i], seq_len).to(query.dtype)
        k = k.transpose(0, 1).repeat_interleave(group, dim=0)  # [num_heads, seq_len, head_dim]
        v = v.transpose(0, 1).repeat_interleave(group, dim=0)
        if q_len == 1:
            o = F.scaled_dot_product_attention(q, k, v, scale=scale)
        else:
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=causal_mask(q_len, seq_len), scale=scale)
        out[start : start + q_len] = o.transpose(0, 1)
        start += q_len
    return out


# A decode group is padded to its longest sequence; sorted by length, a group
# closes when padding would exceed this factor of the real work.
_MAX_DECODE_PADDING = 1.5
_MAX_DECODE_GROUP = 64


def _decode_group(
    query: torch.Tensor,  # [num_seqs, num_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [num_seqs, max_blocks] int32
    seq_lens: list[int],
    scale: float,
) -> torch.Tensor:  # [num_seqs, num_heads, head_dim]
    num_seqs, num_heads, head_dim = query.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    max_seq_len = max(seq_lens)
    max_blocks = (max_seq_len + block_size - 1) // block_size
    block_ids = block_tables[:, :max_blocks].long()  # [num_seqs, max_blocks]
    positions = torch.arange(max_seq_len, device=query.device)  # [max_seq_len]
    lens = torch.tensor(seq_lens, device=query.device)  # [num_seqs]
    mask = (positions < lens.unsqueeze(1)).view(num_seqs, 1, 1, max_seq_len)

    def gather(cache: torch.Tensor) -> torch.Tensor:  # [num_seqs, num_kv_heads, max_seq_len, head_dim]
        blocks = gather_blocks(cache, block_ids.flatten())  # [num_seqs * max_blocks, block_size, kv_heads, head_dim]
        blocks = blocks.view(num_seqs, max_blocks, block_size, num_kv_heads, head_dim)
        context = blocks.flatten(1, 2)[:, :max_seq_len]  # [num_seqs, max_seq_len, num_kv_heads, head_dim]
        return context.to(query.dtype).transpose(1, 2)

    q = query.reshape(num_seqs, num_kv_heads, num_heads // num_kv_heads, head_dim)  # [seqs, kv_heads, group, head_dim]
    out = F.scaled_dot_product_attention(q, gather(k_cache), gather(v_cache), attn_mask=mask, scale=scale)
    return out.reshape(num_seqs, num_heads, head_dim)


def paged_decode_batched(
    query: torch.Tensor,  # [num_seqs, num_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:  # [num_seqs, num_heads, head_dim]
    """``paged_attention`` for a pure-decode batch in one SDPA call.

    Every sequence's context is gathered at once, padded to the longest and
    masked. The query heads of a KV head become the query rows of that head, so
    GQA needs no K/V repeat.
    """
    return _decode_group(query, k_cache, v_cache, meta.block_tables, meta.seq_lens_cpu, scale)


def decode_groups(seq_lens: list[int]) -> list[list[int]]:
    """Indices of decode sequences, sorted by length, cut into groups with little padding."""
    groups: list[list[int]] = []
    current: list[int] = []
    total = 0
    for i in sorted(range(len(seq_lens)), key=seq_lens.__getitem__):
        length = seq_lens[i]
        padded = (len(current) + 1) * length  # sorted ascending: this one is the longest
        if current and (len(current) >= _MAX_DECODE_GROUP or padded > _MAX_DECODE_PADDING * (total + length)):
            groups.append(current)
            current, total = [], 0
        current.append(i)
        total += length
    if current:
        groups.append(current)
    return groups


def _prefill_one(
    query: torch.Tensor,  # [q_len, num_heads, head_dim]
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,  # [max_blocks] int32
    seq_len: int,
    scale: float,
) -> torch.Tensor:  # [q_len, num_heads, head_dim]
    q_len = query.shape[0]
    q = query.transpose(0, 1)  # [num_heads, q_len, head_dim]
    k = _gather_context(k_cache, block_table, seq_len).to(query.dtype).transpose(0, 1)  # [kv_heads, seq_len, head_dim]
    v = _gather_context(v_cache, block_table, seq_len).to(query.dtype).transpose(0, 1)
    if q_len == seq_len:  # no cached prefix: plain causal attention
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=True)
    else:
        mask = causal_mask(q_len, seq_len)
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=True)
    return o.transpose(0, 1)


def paged_attention_fast(
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
    """Same result as ``paged_attention``, faster on CPU: one native kernel call where the
    kernels build (float32), else decode rows of any batch go through a few length-sorted
    batched calls and prefill rows one call each."""
    if cpu_kernels.supports(query, k_cache, v_cache):
        if meta.is_pure_decode:
            result = cpu_kernels.paged_decode(query, k_cache, v_cache, meta.block_tables, meta.seq_lens_cpu, scale)
        else:  # decode rows of a mixed batch go along: one call for the whole step
            result = cpu_kernels.paged_prefill(
                query, k_cache, v_cache, meta.block_tables, meta.query_start_loc, meta.seq_lens, scale
            )
        if result is not None:
            return result
    out = torch.empty_like(query)
    starts = meta.query_start_loc.tolist()
    decode = [i for i, q_len in enumerate(meta.query_lens_cpu) if q_len == 1]
    decode_lens = [meta.seq_lens_cpu[i] for i in decode]
    if decode and cpu_kernels.supports(query, k_cache, v_cache):
        rows = torch.tensor([starts[i] for i in decode])  # [num_decode]
        tables = meta.block_tables[torch.tensor(decode)]  # [num_decode, max_blocks]
        result = cpu_kernels.paged_decode(query[rows], k_cache, v_cache, tables, decode_lens, scale)
        if result is not None:
            out[rows] = result
            decode_lens = []
    for group in decode_groups(decode_lens):
        seqs = [decode[j] for j in group]
        rows = torch.tensor([starts[i] for i in seqs], device=query.device)  # [group]
        tables = meta.block_tables[torch.tensor(seqs, device=query.device)]  # [group, max_blocks]
        lens = [meta.seq_lens_cpu[i] for i in seqs]
        if len(seqs) == 1:
            out[rows] = _prefill_one(query[rows], k_cache, v_cache, tables[0], lens[0], scale)
            continue
        out[rows] = _decode_group(query[rows], k_cache, v_cache, tables, lens, scale)
    for i, q_len in enumerate(meta.query_lens_cpu):
        if q_len > 1:
            begin = starts[i]
            out[begin : begin + q_len] = _prefill_one(
                query[begin : begin + q_len], k_cache, v_cache, meta.block_tables[i], meta.seq_lens_cpu[i], scale
            )
    return out


class TorchAttentionBackend:
    """Attention backend interface: ``write_kv`` then ``forward`` per layer.

    ``forward`` is ``paged_attention_fast``; ``paged_attention`` is the
    reference the tests use.
    """

    name = "torch"

    def write_kv(self, key, value, k_cache, v_cache, slot_mapping) -> None:
        if cpu_kernels.supports_write(key, value, k_cache, v_cache):
            cpu_kernels.write_kv(key, value, k_cache, v_cache, slot_mapping)
        else:
            write_kv(key, value, k_cache, v_cache, slot_mapping)

    def forward(self, query, k_cache, v_cache, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        return paged_attention_fast(query, k_cache, v_cache, meta, scale)
