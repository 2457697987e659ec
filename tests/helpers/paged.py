"""Build paged-attention inputs (metadata, positions, KV cache) for model tests."""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from shared.kernels.metadata import AttentionMetadata
from shared.models.config import ModelConfig

# The KV cache dtypes the CPU attention kernels are built for (shared/kernels/csrc/kv.h), float8 last.
FP8_KV_DTYPES = [torch.float8_e4m3fn, torch.float8_e5m2]
KV_DTYPES = [torch.float32, torch.bfloat16, *FP8_KV_DTYPES]


@dataclass
class SeqChunk:
    """One sequence's share of a step: ``num_new`` tokens after ``num_computed`` cached ones."""

    block_table: list[int]
    num_computed: int
    num_new: int


def build_metadata(chunks: Sequence[SeqChunk], block_size: int) -> tuple[AttentionMetadata, torch.Tensor]:
    """Metadata and positions ([num_tokens] int64) for sequences packed in ``chunks`` order."""
    slots: list[int] = []
    positions: list[int] = []
    query_start = [0]
    for chunk in chunks:
        for pos in range(chunk.num_computed, chunk.num_computed + chunk.num_new):
            block_id = chunk.block_table[pos // block_size]
            slots.append(block_id * block_size + pos % block_size)
            positions.append(pos)
        query_start.append(query_start[-1] + chunk.num_new)
    query_lens = [c.num_new for c in chunks]
    seq_lens = [c.num_computed + c.num_new for c in chunks]
    max_blocks = max(len(c.block_table) for c in chunks)
    tables = [c.block_table + [0] * (max_blocks - len(c.block_table)) for c in chunks]
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.int64),
        query_start_loc=torch.tensor(query_start, dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        block_tables=torch.tensor(tables, dtype=torch.int32),  # [num_seqs, max_blocks]
        max_query_len=max(query_lens),
        max_seq_len=max(seq_lens),
        block_size=block_size,
        query_lens_cpu=query_lens,
        seq_lens_cpu=seq_lens,
    )
    return meta, torch.tensor(positions, dtype=torch.int64)


def make_kv_cache(config: ModelConfig, num_blocks: int, block_size: int, dtype: torch.dtype) -> torch.Tensor:
    # [num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim]
    shape = (num_blocks, config.num_layers, 2, block_size, config.num_kv_heads, config.head_dim)
    return torch.zeros(shape, dtype=dtype)


@dataclass
class PagedSequences:
    """Runs a model step by step over a paged cache with randomly scattered blocks."""

    model: torch.nn.Module
    attn_backend: object
    block_size: int
    max_len: int
    num_seqs: int = 1
    seed: int = 0
    kv_dtype: torch.dtype | None = None  # the cache's dtype; None: the model's
    kv_cache: torch.Tensor = field(init=False)
    block_tables: list[list[int]] = field(init=False)
    num_computed: list[int] = field(init=False)

    def __post_init__(self) -> None:
        blocks_per_seq = -(-self.max_len // self.block_size)
        num_blocks = blocks_per_seq * self.num_seqs + 3  # spare blocks so ids are not simply 0..n
        ids = list(range(num_blocks))
        random.Random(self.seed).shuffle(ids)
        self.block_tables = [ids[i * blocks_per_seq : (i + 1) * blocks_per_seq] for i in range(self.num_seqs)]
        self.kv_cache = make_kv_cache(self.model.config, num_blocks, self.block_size, self.kv_dtype or self.model.dtype)
        self.num_computed = [0] * self.num_seqs

    @torch.no_grad()
    def step(self, new_tokens: dict[int, Sequence[int]]) -> dict[int, torch.Tensor]:
        """Feed each listed sequence its next tokens; return its logits [num_new, vocab] float32."""
        seq_ids = list(new_tokens)
        chunks = [SeqChunk(self.block_tables[s], self.num_computed[s], len(new_tokens[s])) for s in seq_ids]
        meta, positions = build_metadata(chunks, self.block_size)
        input_ids = torch.tensor([t for s in seq_ids for t in new_tokens[s]], dtype=torch.int64)
        hidden = self.model(input_ids, positions, self.kv_cache, meta, self.attn_backend)  # [T, hidden]
        logits = self.model.compute_logits(hidden)  # [T, vocab]
        out = {}
        start = 0
        for s in seq_ids:
            n = len(new_tokens[s])
            out[s] = logits[start : start + n]
            start += n
            self.num_computed[s] += n
        return out
