"""The per-step attention contract shared by every attention backend.

KV cache layout (block-major, one block across all layers is contiguous):
    kv_cache: [num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim]
A layer's K and V are strided views:
    k_cache = kv_cache[:, layer, 0]   # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache = kv_cache[:, layer, 1]   # [num_blocks, block_size, num_kv_heads, head_dim]

A step's tokens are packed sequence by sequence. Sequence ``i`` contributes
``query_start_loc[i+1] - query_start_loc[i]`` new tokens, which are the *last*
tokens of its ``seq_lens[i]``-token context (the earlier ones are already in
the paged cache). Attention is causal: new token ``j`` of sequence ``i`` sees
context positions ``< seq_lens[i] - q_len_i + j + 1``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [num_tokens] int64: block_id * block_size + offset of each new token
    query_start_loc: torch.Tensor  # [num_seqs + 1] int32, cumulative new-token counts
    seq_lens: torch.Tensor  # [num_seqs] int32, context length after this step
    block_tables: torch.Tensor  # [num_seqs, max_blocks_per_seq] int32, padded with 0
    max_query_len: int
    max_seq_len: int
    block_size: int
    # Host copies, so CPU backends can plan without device syncs.
    query_lens_cpu: list[int]
    seq_lens_cpu: list[int]

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_cpu)

    @property
    def is_pure_decode(self) -> bool:
        return self.max_query_len == 1
