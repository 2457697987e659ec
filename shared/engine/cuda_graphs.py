"""CUDA graphs for decode steps.

A pure-decode step (one new token per sequence) is replayed from a graph
captured for the next larger batch size in ``batch_sizes``. Padded rows write
nowhere (slot -1, which the Triton KV-write kernel skips) and attend to one
token of block 0; their outputs are dropped. Graphs are captured with the
largest context (``max_seq_len = max_model_len``): attention programs past a
sequence's real length exit early, so one graph serves every context length.
"""

from __future__ import annotations

import bisect
import logging
import time
from typing import Any

import torch

from shared.kernels.metadata import AttentionMetadata

logger = logging.getLogger("cleave.engine")

DEFAULT_BATCH_SIZES = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 224, 256, 320, 384, 448, 512)


class DecodeGraphs:
    def __init__(self, model, kv_cache: torch.Tensor, attn_backend, block_size: int, max_model_len: int,
                 max_num_seqs: int, batch_sizes: tuple[int, ...] = DEFAULT_BATCH_SIZES) -> None:  # fmt: skip
        self.model = model
        self.kv_cache = kv_cache
        self.attn_backend = attn_backend
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.max_blocks = -(-max_model_len // block_size)
        sizes = [b for b in batch_sizes if b < max_num_seqs] + [max_num_seqs]
        self.batch_sizes = sorted(set(sizes))
        device = kv_cache.device
        n = self.batch_sizes[-1]
        self.input_ids = torch.zeros(n, dtype=torch.int64, device=device)  # [max_batch]
        self.positions = torch.zeros(n, dtype=torch.int64, device=device)  # [max_batch]
        self.slot_mapping = torch.full((n,), -1, dtype=torch.int64, device=device)  # [max_batch]
        self.seq_lens = torch.ones(n, dtype=torch.int32, device=device)  # [max_batch]
        self.block_tables = torch.zeros(n, self.max_blocks, dtype=torch.int32, device=device)  # [max_batch, max_blocks]
        self.query_start_loc = torch.arange(n + 1, dtype=torch.int32, device=device)  # [max_batch + 1]
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self.pool: Any = None  # the graphs' shared memory pool, set by the first capture
        # Without captured graphs (CPU tests), run() pads exactly the same way and runs eagerly.
        self.enabled = False

    def _meta(self, batch: int) -> AttentionMetadata:
        return AttentionMetadata(
            slot_mapping=self.slot_mapping[:batch],
            query_start_loc=self.query_start_loc[: batch + 1],
            seq_lens=self.seq_lens[:batch],
            block_tables=self.block_tables[:batch],
            max_query_len=1,
            max_seq_len=self.max_model_len,
            block_size=self.block_size,
            query_lens_cpu=[1] * batch,
            seq_lens_cpu=[self.max_model_len] * batch,
        )

    def _forward(self, batch: int) -> torch.Tensor:
        return self.model(self.input_ids[:batch], self.positions[:batch], self.kv_cache, self._meta(batch),
                          self.attn_backend)  # fmt: skip

    @torch.inference_mode()
    def capture(self) -> None:
        start = time.perf_counter()
        for batch in reversed(self.batch_sizes):  # largest first, so smaller graphs reuse its memory pool
            self._forward(batch)  # warm up (compiles kernels outside the capture)
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool):
                self.outputs[batch] = self._forward(batch)
            if self.pool is None:
                self.pool = graph.pool()
            self.graphs[batch] = graph
        torch.cuda.synchronize()
        self.enabled = True
        logger.info("cuda_graphs_captured batch_sizes=%s seconds=%.1f", self.batch_sizes, time.perf_counter() - start)

    def padded_batch(self, num_seqs: int) -> int | None:
        i = bisect.bisect_left(self.batch_sizes, num_seqs)
        return self.batch_sizes[i] if i < len(self.batch_sizes) else None

    def can_run(self, meta: AttentionMetadata) -> bool:
        return (
            self.enabled
            and meta.is_pure_decode
            and meta.num_seqs <= self.batch_sizes[-1]
            and meta.block_tables.shape[1] <= self.max_blocks
        )

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """Hidden states [num_seqs, hidden] of a pure-decode step, replayed from a graph."""
        num_seqs = meta.num_seqs
        batch = self.padded_batch(num_seqs)
        assert batch is not None
        self.input_ids[:num_seqs].copy_(input_ids)
        self.positions[:num_seqs].copy_(positions)
        self.slot_mapping[:num_seqs].copy_(meta.slot_mapping)
        self.slot_mapping[num_seqs:batch].fill_(-1)
        self.seq_lens[:num_seqs].copy_(meta.seq_lens)
        self.seq_lens[num_seqs:batch].fill_(1)
        width = meta.block_tables.shape[1]
        self.block_tables[:num_seqs, :width].copy_(meta.block_tables)
        self.block_tables[num_seqs:batch].zero_()
        if batch in self.graphs:
            self.graphs[batch].replay()
            return self.outputs[batch][:num_seqs]
        return self._forward(batch)[:num_seqs]
