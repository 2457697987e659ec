"""Turns one ``SchedulerOutput`` into a forward pass and sampled tokens."""

from __future__ import annotations

import logging
import math
import mmap
import time
from array import array
from collections.abc import Callable
from itertools import accumulate
from typing import Any

import torch

from shared.engine.cpu_alloc import huge_page_mapping
from shared.engine.cuda_graphs import DecodeGraphs
from shared.engine.pooling import Pooler
from shared.engine.prompt_logprobs import compute_prompt_logprobs
from shared.engine.request import TokenSample
from shared.engine.sampler import Sampler, SamplingBatch, make_generator, token_seed
from shared.engine.scheduler import SchedulerOutput
from shared.kernels import cpu_kernels
from shared.kernels.metadata import AttentionMetadata
from shared.models.config import ModelConfig
from shared.models.llama import LlamaModel

logger = logging.getLogger("cleave.engine")
_MADV_POPULATE_WRITE = getattr(mmap, "MADV_POPULATE_WRITE", 23)  # Linux 5.14

_DTYPES = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float8_e4m3fn": torch.float8_e4m3fn,
    "float8_e5m2": torch.float8_e5m2,
}  # float8: KV caches only


def torch_dtype(name: str) -> torch.dtype:
    if name not in _DTYPES:
        raise ValueError(f"dtype {name!r} is not supported; use one of {', '.join(_DTYPES)}")
    return _DTYPES[name]


def allocate_kv_cache(
    shape: tuple[int, ...], dtype: torch.dtype, device: torch.device, prefault: bool = True
) -> torch.Tensor:
    """A zeroed KV cache. On CPU it is backed by an anonymous mapping (huge pages where the OS has them).

    With ``prefault`` (the default) every page is made resident here, as a GPU cache is allocated whole:
    otherwise the OS supplies each page on its first touch, inside the steps that first use its blocks.
    The free queue hands out blocks least recently freed first (what keeps cached prefixes longest), so
    a server walks the whole budget before it reuses a block, and on a virtual machine a page the guest
    has never touched (or has handed back to the host) costs about as much as computing a prefill's
    worth of tokens into it. Without it, resident memory grows with the blocks used so far."""
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    count = math.prod(shape)
    num_bytes = count * torch.tensor([], dtype=dtype).element_size()
    buffer, offset = huge_page_mapping(num_bytes)
    # the tensor keeps the mapping alive
    cache = torch.frombuffer(buffer, dtype=dtype, count=count, offset=offset).view(shape)
    if prefault:
        start = time.perf_counter()
        method = make_resident(buffer, offset, num_bytes, cache)
        logger.info("kv_cache_prefault bytes=%d seconds=%.2f method=%s", num_bytes, time.perf_counter() - start,
                    method)  # fmt: skip
    return cache


def make_resident(buffer: mmap.mmap, offset: int, num_bytes: int, view: torch.Tensor) -> str:
    """Fault in ``num_bytes`` of an anonymous mapping from ``offset``: one ``madvise(MADV_POPULATE_WRITE)``
    where the kernel has it (Linux 5.14+), else a write of zeros through ``view``."""
    try:
        buffer.madvise(_MADV_POPULATE_WRITE, offset, num_bytes)
        return "madvise"
    except (OSError, ValueError):
        view.zero_()
        return "write"


def select_rows(hidden: torch.Tensor, rows: list[int]) -> torch.Tensor:
    """``hidden[rows]``, on the CPU without starting torch's parallel threads (see csrc/rows.c)."""
    index = torch.tensor(rows, device=hidden.device)
    if hidden.device.type == "cpu":
        picked = cpu_kernels.gather_rows(hidden, index)
        if picked is not None:
            return picked
    return hidden[index]


_ARRAY_TYPECODES = {torch.int32: "i", torch.int64: "q"}


def int_tensor(values: list[int], dtype: torch.dtype) -> torch.Tensor:
    """``torch.tensor(values, dtype=dtype)`` on the CPU, read from a C array that the tensor keeps alive:
    ``torch.tensor`` checks every Python int on its own (a decode step's block table of 64 x 17 took
    about 60 us that way, against about 10 through an array)."""
    if not values:
        return torch.empty(0, dtype=dtype)
    return torch.frombuffer(array(_ARRAY_TYPECODES[dtype], values), dtype=dtype)


def kv_block_bytes(config: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    """Bytes of one block across all layers (K and V)."""
    return block_size * config.kv_bytes_per_token_per_elem * torch.tensor([], dtype=dtype).element_size()


class ModelRunner:
    def __init__(
        self,
        model: LlamaModel,
        model_config: ModelConfig,
        num_blocks: int,
        block_size: int,
        kv_dtype: torch.dtype,
        device: torch.device,
        attn_backend,
        eos_token_ids: tuple[int, ...] = (),
        prefault_kv_cache: bool = True,
    ) -> None:
        self.model = model
        self.config = model_config
        self.block_size = block_size
        self.device = device
        self.attn_backend = attn_backend
        self.eos_token_ids = eos_token_ids
        # [num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim]
        shape = (num_blocks, model_config.num_layers, 2, block_size, model_config.num_kv_heads, model_config.head_dim)
        self.kv_cache = allocate_kv_cache(shape, kv_dtype, device, prefault_kv_cache)
        self.sampler = Sampler()
        self._generators: dict[str, torch.Generator | None] = {}
        self.graphs: DecodeGraphs | None = None
        # Prompt logprobs of the last step, per request: (first prompt position, samples); see take_prompt_logprobs.
        self._prompt_logprobs: dict[str, tuple[int, list[TokenSample]]] = {}
        self.pooler = Pooler()
        self._embeddings: dict[str, list[float]] = {}  # finished in the last step; see take_embeddings
        self._bitmask_filler: Any = None  # created on the first constrained step (imports xgrammar)

    def prepare_cpu_forward(self) -> None:
        """Build now what the first CPU step would build: the one-call forward (``CpuStack``) and the packed
        copies of the projections and the LM head (``cpu_kernels.packed_weight``). Made lazily, they put
        a third of a second (SmolLM2-135M on 2 cores) on the first request's latency; the steps run the
        same either way. Nothing to do where they do not apply (a GPU, bfloat16 weights)."""
        if self.device.type != "cpu":
            return
        self.model.cpu_stack(self.attn_backend)
        head = self.model.output_weight
        if head.dtype == torch.float32:
            cpu_kernels.kernel_copies(head)

    def capture_decode_graphs(self, max_model_len: int, max_num_seqs: int) -> None:
        """CUDA only, with the Triton backend: replay decode steps from CUDA graphs."""
        self.graphs = DecodeGraphs(self.model, self.kv_cache, self.attn_backend, self.block_size, max_model_len,
                                   max_num_seqs)  # fmt: skip
        self.graphs.capture()

    def release(self, request_id: str) -> None:
        self._generators.pop(request_id, None)
        self.pooler.release(request_id)

    def _generator(self, request_id: str, seed: int | None, index: int) -> torch.Generator | None:
        """The request's generator, seeded for its output token ``index`` (None when unseeded)."""
        if request_id not in self._generators:
            self._generators[request_id] = make_generator(seed, self.device)
        generator = self._generators[request_id]
        if generator is not None and seed is not None:
            generator.manual_seed(token_seed(seed, index))
        return generator

    def _prepare(self, sched: SchedulerOutput) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        query_lens = [len(s.token_ids) for s in sched.seqs]
        seq_lens = [s.start_pos + n for s, n in zip(sched.seqs, query_lens, strict=True)]
        max_blocks = max(len(s.block_ids) for s in sched.seqs)
        # One tensor from one flat list of padded rows: a tensor per sequence, or one from nested lists,
        # cost more than the rest of the preparation.
        padded: list[int] = []
        for s in sched.seqs:
            padded += s.block_ids
            padded += [0] * (max_blocks - len(s.block_ids))
        block_tables = int_tensor(padded, torch.int32).view(len(sched.seqs), max_blocks)  # [S, max_blocks]
        # Positions and slots from Python ranges, a run per block: torch's index ops here would each
        # start a parallel region, whose threads then spin on the cores the forward is about to use.
        bs = self.block_size
        positions_list: list[int] = []
        slots: list[int] = []
        if min(query_lens) == max(query_lens) == 1:  # a decode step: one token per sequence
            input_ids = int_tensor([s.token_ids[0] for s in sched.seqs], torch.int64)  # [T]
            positions_list = [s.start_pos for s in sched.seqs]
            slots = [s.block_ids[pos // bs] * bs + pos % bs for s, pos in zip(sched.seqs, positions_list, strict=True)]
        else:
            input_ids = int_tensor([t for s in sched.seqs for t in s.token_ids], torch.int64)  # [T]
            for s, end in zip(sched.seqs, seq_lens, strict=True):
                pos = s.start_pos
                positions_list.extend(range(pos, end))
                while pos < end:
                    block, offset = divmod(pos, bs)
                    run = min(bs - offset, end - pos)
                    first = s.block_ids[block] * bs + offset
                    slots.extend(range(first, first + run))
                    pos += run
        positions = int_tensor(positions_list, torch.int64)  # [T]
        slot_mapping = int_tensor(slots, torch.int64)  # [T]
        cu = int_tensor([0, *accumulate(query_lens)], torch.int32)  # [S + 1]
        device = self.device
        meta = AttentionMetadata(
            slot_mapping=slot_mapping.to(device),
            query_start_loc=cu.to(device),
            seq_lens=int_tensor(seq_lens, torch.int32).to(device),
            block_tables=block_tables.to(device),
            max_query_len=max(query_lens),
            max_seq_len=max(seq_lens),
            block_size=self.block_size,
            query_lens_cpu=query_lens,
            seq_lens_cpu=seq_lens,
        )
        return input_ids.to(device), positions.to(device), meta

    def _copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        if copies:
            src = torch.tensor([c[0] for c in copies], device=self.device)
            dst = torch.tensor([c[1] for c in copies], device=self.device)
            self.kv_cache[dst] = self.kv_cache[src]

    @torch.inference_mode()
    def execute(
        self, sched: SchedulerOutput, before_forward: Callable[[], None] | None = None
    ) -> dict[str, list[TokenSample]]:
        """Run the step; returns, per sampling sequence, one sample per request in ``sample_request_ids``.

        ``before_forward`` runs once, just before the model's compute starts (or at once for an empty step).
        """
        self._copy_blocks(sched.block_copies)
        if sched.is_empty:
            if before_forward is not None:
                before_forward()
            return {}
        input_ids, positions, meta = self._prepare(sched)
        if self.graphs is not None and self.graphs.can_run(meta):
            if before_forward is not None:
                before_forward()
            hidden = self.graphs.run(input_ids, positions, meta)  # [T, hidden]
        else:
            hidden = self.model(input_ids, positions, self.kv_cache, meta, self.attn_backend,
                                before_compute=before_forward)  # fmt: skip  # [T, hidden]
        self._prompt_logprobs = compute_prompt_logprobs(hidden, sched, self.model.compute_logits)
        self._embeddings = self.pooler.step(hidden, sched)
        rows, params, prompts, outputs, matchers = [], [], [], [], []
        generators: list[torch.Generator | None] = []
        end = 0
        for seq in sched.seqs:
            end += len(seq.token_ids)
            for j, sample_id in enumerate(seq.sample_request_ids):
                rows.append(end - 1)
                params.append(seq.sampling_params)
                prompts.append(seq.prompt_token_ids)
                outputs.append(seq.output_token_ids)
                matchers.append(seq.matchers[j] if seq.matchers else None)
                seed = seq.sampling_params.seed
                if seed is None:  # draws from the global generator
                    generators.append(None)
                else:
                    index = len(seq.output_token_ids)
                    generators.append(self._generator(sample_id, seed + seq.seed_offset + j, index))
        if not rows:
            return {}
        # Every token's row once, in order (a decode step of single samples): no gather.
        every_row = len(rows) == hidden.shape[0] and rows == list(range(len(rows)))
        last = hidden if every_row else select_rows(hidden, rows)
        logits = self.model.compute_logits(last)  # [B, vocab]
        batch = SamplingBatch.build(
            params, prompts, outputs, generators, self.eos_token_ids, logits.shape[-1], self.device
        )
        if any(m is not None for m in matchers):
            self._add_bitmask(batch, matchers, logits.shape[-1])
        out = self.sampler(logits, batch, inplace=True)  # the step's own logits
        return self._collect(sched, out, batch)

    def take_embeddings(self) -> dict[str, list[float]]:
        """The embeddings the last ``execute`` finished (each taken once)."""
        taken, self._embeddings = self._embeddings, {}
        return taken

    def take_prompt_logprobs(self) -> dict[str, tuple[int, list[TokenSample]]]:
        """The prompt logprobs the last ``execute`` computed (each step's are taken once)."""
        taken, self._prompt_logprobs = self._prompt_logprobs, {}
        return taken

    def _add_bitmask(self, batch: SamplingBatch, matchers: list, vocab_size: int) -> None:
        """Structured output: masks for the rows that carry a grammar matcher, and only those."""
        from shared.structured.grammar import BitmaskFiller

        if self._bitmask_filler is None:
            self._bitmask_filler = BitmaskFiller()
        rows = [row for row, m in enumerate(matchers) if m is not None]
        bitmask = self._bitmask_filler.fill(matchers, rows, vocab_size)  # [B, W], only `rows` filled
        batch.token_bitmask = bitmask.to(self.device, non_blocking=True)
        batch.constrained_rows = rows

    def _collect(self, sched: SchedulerOutput, out, batch: SamplingBatch) -> dict[str, list[TokenSample]]:
        token_ids = out.token_ids.tolist()
        logprobs = out.logprobs.tolist()
        top_ids = out.top_token_ids.tolist() if out.top_token_ids is not None else None
        top_lps = out.top_logprobs.tolist() if out.top_logprobs is not None else None
        results: dict[str, list[TokenSample]] = {}
        row = 0
        for seq in sched.seqs:
            if not seq.sample_request_ids:
                continue
            samples = []
            k = seq.sampling_params.logprobs
            for _ in seq.sample_request_ids:
                top = None
                if k is not None and top_ids is not None and top_lps is not None:
                    top = list(zip(top_ids[row][:k], top_lps[row][:k], strict=True))
                samples.append(TokenSample(token_ids[row], logprobs[row], top))
                row += 1
            results[seq.request_id] = samples
        return results
