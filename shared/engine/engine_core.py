"""The incremental engine API the services drive: ``add_request``, ``step``, ``abort``.

Token ids in, token ids out; text (detokenization, stop strings) is the
caller's business, so the same core serves the offline API and the workers.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from shared.config import FP8_KV_CACHE_DTYPES, EngineConfig, default_step_tokens
from shared.engine.beam_search import BeamGroup, BeamSearch
from shared.engine.cpu_alloc import keep_freed_memory
from shared.engine.cpu_threads import CoreShare, ThreadGovernor
from shared.engine.cpu_threads import enabled as thread_governor_enabled
from shared.engine.kv_cache_manager import KVCacheManager
from shared.engine.kv_connector import KVConnectorScheduler
from shared.engine.kv_leases import LEASE, KVLeases, ownership_problems
from shared.engine.model_runner import ModelRunner, kv_block_bytes, torch_dtype
from shared.engine.prompt_logprobs import record as record_prompt_logprobs
from shared.engine.request import Request, RequestStatus, TokenSample
from shared.engine.sampling_params import InvalidRequestError, SamplingParams
from shared.engine.scheduler import Scheduler, SchedulerConfig
from shared.kernels import cpu_kernels, get_attention_backend
from shared.models.loader import load_model
from shared.structured.constraint import Constraint

logger = logging.getLogger("cleave.engine")


@dataclass
class RequestOutputDelta:
    """New tokens of one request from one step."""

    request_id: str
    new_token_ids: list[int]
    new_samples: list[TokenSample] = field(default_factory=list)
    finished: bool = False
    finish_reason: str | None = None  # "stop", "length" or "abort"
    parent_request_id: str | None = None  # for the children of an n>1 request
    sample_index: int = 0
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    prompt_logprobs: list[TokenSample] | None = None  # on a request's first delta, when asked for
    embedding: list[float] | None = None  # embedding requests (SamplingParams.pooling): the pooled vector


@dataclass
class EngineStats:
    num_running: int
    num_waiting: int
    num_free_blocks: int
    num_total_blocks: int
    kv_cache_usage: float
    prefix_cache_queries: int
    prefix_cache_hits: int
    num_preemptions: int
    num_prompt_tokens_computed: int
    num_generation_tokens: int
    num_leased_requests: int = 0
    num_held_blocks: int = 0  # blocks held by leases and pulls in flight
    num_leases_expired: int = 0
    num_pull_cached_tokens: int = 0  # prompt tokens KV pulls found in the local prefix cache (not pulled)


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


# ``auto`` on the CPU runs a bfloat16 checkpoint in float32 up to this many parameters where the CPU has no
# bfloat16 products (4 GiB of float32 weights per worker; ``--dtype bfloat16`` likewise): the CPU's native
# kernels (projections, attention, the one-call forward) are float32, and a bfloat16 model there runs on
# generic torch operators at about half the tokens/s (the 12M Llama on 2 cores: 883 against 1,760 output
# tok/s offline). Above it, half the memory matters more (every worker process of a cluster holds its own
# copy). Where the CPU has AVX512-BF16 or AMX the weights are held as bfloat16 (cpu_kernels.hold_as_bfloat16)
# and there is no limit.
CPU_FLOAT32_MAX_PARAMETERS = 1 << 30


def _resolve_dtype(name: str, checkpoint_dtype: str, device: torch.device, num_parameters: int = 0) -> str:
    """``auto``: bfloat16 on CUDA; on CPU float32, but bfloat16 for a bfloat16 checkpoint of more than
    ``CPU_FLOAT32_MAX_PARAMETERS`` (float16 checkpoints run in float32). Decided by the checkpoint alone, so
    that every worker of a cluster picks the same (their KV caches must agree)."""
    if name != "auto":
        return name
    if device.type == "cuda":
        return "bfloat16"
    if checkpoint_dtype == "bfloat16" and num_parameters > CPU_FLOAT32_MAX_PARAMETERS:
        return "bfloat16"
    return "float32"


def resolve_kv_dtype(name: str, dtype_flag: str, dtype_name: str, checkpoint_dtype: str, device: torch.device) -> str:
    """``auto``: the model's dtype, but bfloat16 for a bfloat16 checkpoint that ``--dtype auto`` runs in float32
    on the CPU (``--dtype float32`` asks for float32 weights and cache): its keys and values rounded to the
    checkpoint's own precision, half the bytes a token (twice the tokens in the same
    ``--kv-cache-memory``, half the memory traffic of decode attention, which at batch 64 is about half a step).
    Decided by the checkpoint and the flags alone, as the dtype is: a prefill and a decode worker must agree. On
    CUDA the cache must be the model's dtype (the Triton kernels read it as the queries' dtype). A float8 name
    (``fp8``, ``fp8_e4m3``, ``fp8_e5m2``) becomes torch's (``float8_e4m3fn``, ``float8_e5m2``)."""
    if name == "auto":
        if device.type == "cpu" and dtype_flag == "auto" and checkpoint_dtype == "bfloat16" and dtype_name == "float32":
            return "bfloat16"
        return dtype_name
    if device.type == "cuda" and name != dtype_name:
        raise ValueError(
            f"--kv-cache-dtype {name} with a {dtype_name} model: on CUDA the KV cache is the model's dtype"
            + (" (float8 caches run on the CPU only)" if name in FP8_KV_CACHE_DTYPES else "")
        )
    return FP8_KV_CACHE_DTYPES.get(name, name)


class EngineCore:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.device = resolve_device(config.device)
        if self.device.type == "cpu":
            keep_freed_memory()
        t0 = time.perf_counter()
        from shared.models.config import load_model_config

        checkpoint = load_model_config(config.model)
        self.dtype_name = _resolve_dtype(config.dtype, checkpoint.torch_dtype, self.device, checkpoint.num_parameters)
        if self.dtype_name != checkpoint.torch_dtype:
            logger.info("dtype %s checkpoint runs in %s (--dtype %s)", checkpoint.torch_dtype, self.dtype_name,
                        config.dtype)  # fmt: skip
        # A bfloat16 checkpoint that runs in float32 on the CPU, and any checkpoint run at --dtype bfloat16
        # there: bfloat16 weights computed by the float32 kernels, their projections on bfloat16 products where
        # the CPU has them (cpu_kernels.bfloat16_holding), held then as their bfloat16 copies alone (2 bytes a
        # value, as a bfloat16 model; a float32 matrix beside its copy took 6) at any size, and otherwise as
        # float32 values up to CPU_FLOAT32_MAX_PARAMETERS. A bfloat16 model on torch's generic CPU operators
        # ran the 12M Llama at 950 output tok/s offline, against 2,840-3,040 so on AVX512-BF16 (Zen 4) and
        # 1,574 for the float32 model.
        holding = self.device.type == "cpu" and cpu_kernels.bfloat16_holding()
        bfloat16_values = self.device.type == "cpu" and (
            (checkpoint.torch_dtype == "bfloat16" and self.dtype_name == "float32")
            or (self.dtype_name == "bfloat16" and (checkpoint.num_parameters <= CPU_FLOAT32_MAX_PARAMETERS or holding))
        )
        self.model, self.model_config = load_model(config.model, "float32" if bfloat16_values else self.dtype_name,
                                                   self.device, bfloat16_projections=bfloat16_values and holding)  # fmt: skip
        if bfloat16_values:
            if self.dtype_name == "bfloat16":
                with torch.no_grad():
                    for param in self.model.parameters():
                        if cpu_kernels.held_shape(param) is None:  # (the held ones were rounded as they loaded)
                            param.copy_(param.to(torch.bfloat16))  # the values a bfloat16 load would hold
            # Their projections may run on AMX or AVX512-BF16, which round their inputs to bfloat16 as a
            # bfloat16 model would (cpu_kernels.amx_weight), from half the bytes; the rest stays float32.
            cpu_kernels.mark_bfloat16_values(self.model.projection_weights())
            logger.info("bfloat16 weights on the CPU: float32 kernels, projections on %s%s",
                        cpu_kernels.amx_unit() or "the float32 kernel",
                        ", held as their bfloat16 copies" if holding else "")  # fmt: skip
        self.kv_dtype_name = resolve_kv_dtype(config.kv_cache_dtype, config.dtype, self.dtype_name,
                                              checkpoint.torch_dtype, self.device)  # fmt: skip
        kv_dtype = torch_dtype(self.kv_dtype_name)
        self.num_blocks = self._num_blocks(kv_dtype)
        model_len = config.max_model_len or self.model_config.max_position_embeddings
        window = self.model_config.sliding_window
        if window and model_len > window:
            # Attention here always spans the whole context, which equals sliding-window
            # attention only while the context fits in the window.
            logger.info("max_model_len capped to the sliding window (%d tokens)", window)
            model_len = window
        self.max_model_len = min(model_len, self.num_blocks * config.block_size)
        self.eos_token_ids = frozenset(self.model_config.eos_token_ids)
        self.kv = KVCacheManager(self.num_blocks, config.block_size, config.enable_prefix_caching)
        self.max_num_batched_tokens = config.max_num_batched_tokens or default_step_tokens(
            self.device.type, self.model_config.layer_parameters
        )
        self.leases = KVLeases(self.kv)
        self.scheduler = Scheduler(
            SchedulerConfig(
                max_num_batched_tokens=self.max_num_batched_tokens,
                max_num_seqs=config.max_num_seqs,
                max_model_len=self.max_model_len,
                long_prefill_token_threshold=config.long_prefill_token_threshold,
                scheduling_policy=config.scheduling_policy,
            ),
            self.kv,
        )
        # Remote KV (a decode worker's pulls) enters through the connector's scheduler side.
        self.kv_connector = KVConnectorScheduler(self.kv, self.scheduler, self.leases)
        self.beams = BeamSearch(self.scheduler, self.kv)
        self.runner = ModelRunner(
            self.model,
            self.model_config,
            self.num_blocks,
            config.block_size,
            kv_dtype,
            self.device,
            get_attention_backend(self.device, config.attention_backend),
            tuple(self.model_config.eos_token_ids),
            config.kv_cache_prefault,
        )
        if self.device.type == "cuda" and not config.enforce_eager and self.runner.attn_backend.name == "triton":
            self.runner.capture_decode_graphs(self.max_model_len, config.max_num_seqs)
        self.runner.prepare_cpu_forward()
        self.num_prompt_tokens_computed = 0
        self.num_generation_tokens = 0
        # CPU: each step gets the cores no other process wants (see shared.engine.cpu_threads).
        self.thread_governor = (
            ThreadGovernor(torch.get_num_threads())
            if self.device.type == "cpu" and torch.get_num_threads() > 1 and thread_governor_enabled()
            else None
        )
        # CPUs lent between the workers of one box (cpu_threads.CoreShare; set by the worker): None: none.
        self.core_share: CoreShare | None = None
        # Called on the engine thread with each step's number of batched tokens (metrics); None: off.
        self.on_step: Callable[[int], None] | None = None
        self._grammar: Any = None  # GrammarBackend, made on the first constrained request
        self._grammar_lock = threading.Lock()
        block_bytes = kv_block_bytes(self.model_config, config.block_size, kv_dtype)
        logger.info(
            "engine ready model=%s device=%s dtype=%s kv_dtype=%s kv_blocks=%d block_size=%d kv_cache_bytes=%d "
            "max_tokens_in_cache=%d max_model_len=%d step_tokens=%d scheduling_policy=%s load_seconds=%.2f",
            config.model, self.device, self.dtype_name, self.kv_dtype_name, self.num_blocks, config.block_size,
            self.num_blocks * block_bytes, self.num_blocks * config.block_size, self.max_model_len,
            self.max_num_batched_tokens, config.scheduling_policy, time.perf_counter() - t0,
        )  # fmt: skip

    def _num_blocks(self, dtype: torch.dtype) -> int:
        if self.config.num_blocks is not None:
            return self.config.num_blocks
        block_bytes = kv_block_bytes(self.model_config, self.config.block_size, dtype)
        if self.device.type == "cuda":
            free, total = torch.cuda.mem_get_info(self.device)
            used = total - free
            budget = int(total * self.config.gpu_memory_utilization) - used - (1 << 30)  # 1 GiB for activations
        else:
            budget = self.config.kv_cache_memory
        num_blocks = budget // block_bytes
        if num_blocks < 1:
            raise ValueError(
                f"KV cache budget of {budget} bytes holds no block of {block_bytes} bytes; "
                "raise --kv-cache-memory (CPU) or --gpu-memory-utilization (CUDA)"
            )
        return int(num_blocks)

    # ---- requests -------------------------------------------------------------------------

    def validate(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        if not prompt_token_ids:
            raise InvalidRequestError("the prompt is empty; send at least one token")
        vocab = self.model_config.vocab_size
        bad = [t for t in prompt_token_ids if not isinstance(t, int) or not 0 <= t < vocab]
        if bad:
            raise InvalidRequestError(f"token id {bad[0]!r} is outside the vocabulary [0, {vocab})")
        if len(prompt_token_ids) >= self.max_model_len:
            raise InvalidRequestError(
                f"the prompt has {len(prompt_token_ids)} tokens, but this model's maximum context length is "
                f"{self.max_model_len} tokens (including at least one generated token); shorten the prompt"
            )
        params.validate()
        if params.pooling is not None and (params.max_tokens != 1 or params.n != 1):
            raise InvalidRequestError("embedding requests (pooling) take max_tokens=1 and n=1")
        if params.constraint is not None and params.min_tokens > 0:
            # A complete grammar allows only EOS, which min_tokens forbids: nothing could be sampled.
            raise InvalidRequestError("min_tokens cannot be combined with a structured-output constraint")

    def make_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams) -> Request:
        self.validate(prompt_token_ids, params)
        if request_id in self.scheduler.requests or request_id in self.leases or request_id in self.beams.groups:
            raise InvalidRequestError(f"request id {request_id!r} is already in use")
        request = self._new_request(request_id, prompt_token_ids, params)
        if params.use_beam_search:
            return self.beams.start(request)
        request.pending_children = [
            self._new_request(f"{request_id}/{i}", prompt_token_ids, params, parent=request_id, index=i)
            for i in range(1, params.n)
        ]
        if params.constraint is not None:
            for r in [request, *request.pending_children]:
                r.matcher = self.grammar_backend().matcher(params.constraint)
        return request

    def resume(self, request: Request, generated_token_ids: list[int]) -> None:
        """Give a fresh request the tokens it already generated elsewhere (its grammar replays them)."""
        vocab = self.model_config.vocab_size
        if len(generated_token_ids) >= request.max_tokens:
            raise InvalidRequestError(f"{len(generated_token_ids)} generated tokens leave no room under max_tokens")
        for token_id in generated_token_ids:
            if not 0 <= token_id < vocab:
                raise InvalidRequestError(f"generated token id {token_id} is outside the vocabulary [0, {vocab})")
            if not request.append_output_token(token_id):
                raise InvalidRequestError(f"generated token id {token_id} breaks the request's output constraint")

    # ---- structured output ----------------------------------------------------------------

    def grammar_backend(self) -> Any:
        """The xgrammar backend of this model's tokenizer (built once; any thread)."""
        with self._grammar_lock:
            if self._grammar is None:
                from shared.structured.grammar import GrammarBackend

                self._grammar = GrammarBackend.from_model_dir(
                    self.config.model, self.model_config.vocab_size, sorted(self.eos_token_ids)
                )
            return self._grammar

    def compile_constraint(self, constraint: Constraint) -> float | None:
        """Compile (or find cached) ``constraint``; thread-safe, so callers run it off the engine thread.

        Returns the seconds compiling took, None on a cache hit. Raises InvalidRequestError with the
        reason when the schema, regex or grammar does not compile.
        """
        backend = self.grammar_backend()
        if backend.cached(constraint):
            backend.compile(constraint)  # refresh its place in the LRU
            return None
        start = time.perf_counter()
        backend.compile(constraint)
        return time.perf_counter() - start

    def _new_request(self, request_id, prompt_token_ids, params, parent=None, index=0) -> Request:
        return Request(
            request_id=request_id,
            prompt_token_ids=list(prompt_token_ids),
            sampling_params=params,
            eos_token_ids=self.eos_token_ids,
            max_model_len=self.max_model_len,
            seed_offset=index,
            parent_request_id=parent,
        )

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams) -> Request:
        """Queue a request; raises InvalidRequestError (engine state unchanged) on bad input."""
        request = self.make_request(request_id, prompt_token_ids, params)
        self.scheduler.add_request(request)
        return request

    def abort(self, request_id: str) -> bool:
        """Stop a request (a beam-search group: all its beams), or free its finished prefill's lease;
        False if neither exists."""
        beam_ids = self.beams.abort(request_id)
        if beam_ids is not None:
            for beam_id in beam_ids:
                self.runner.release(beam_id)
            return True
        request = self.scheduler.abort(request_id)
        if request is None:
            return self.leases.release(request_id, kinds=(LEASE,))
        self.runner.release(request_id)
        return True

    def expire_leases(self, now: float | None = None) -> list[str]:
        """Free the leases whose deadline has passed; returns their request ids."""
        if not self.leases.holds:
            return []
        return self.leases.expire(time.monotonic() if now is None else now)

    def ownership_problems(self) -> list[str]:
        """The block-ownership invariant: used blocks = blocks of scheduled requests + leases + pulls."""
        return ownership_problems(self.kv, set(self.scheduler.requests), self.leases)

    def has_unfinished(self) -> bool:
        return self.scheduler.num_unfinished > 0

    # ---- the loop -------------------------------------------------------------------------

    def step(
        self,
        before_forward: Callable[[], None] | None = None,
        after_execute: Callable[[], None] | None = None,
    ) -> list[RequestOutputDelta]:
        """One iteration: schedule, run the model, sample, update. ``before_forward`` runs just before the
        model's forward, while nothing of this step has changed what callers see; ``after_execute`` once
        the tokens are sampled, before the scheduler sees them."""
        if self.thread_governor is not None:
            self.thread_governor.before_step()
        if self.core_share is not None:
            self.core_share.before_step(self.scheduler.num_unfinished)
        sched = self.scheduler.schedule()
        try:
            samples = self.runner.execute(sched, before_forward)
        finally:
            if after_execute is not None:
                after_execute()
        embeddings = self.runner.take_embeddings()
        for request_id, (first_position, scored) in self.runner.take_prompt_logprobs().items():
            scored_request = self.scheduler.requests.get(request_id)
            if scored_request is not None:
                record_prompt_logprobs(scored_request.prompt_logprobs, first_position, scored)
        if self.on_step is not None:
            self.on_step(sched.num_batched_tokens)
        deltas: list[RequestOutputDelta] = []
        for seq in sched.seqs:
            if seq.start_pos < len(seq.prompt_token_ids):
                self.num_prompt_tokens_computed += min(len(seq.token_ids), len(seq.prompt_token_ids) - seq.start_pos)
        for request, sample in self.scheduler.update_from_output(sched, samples):
            self.num_generation_tokens += 1
            if self.beams.groups and self.beams.owns(request.request_id):
                self.beams.report(request, sample)
                continue
            delta = self._delta(request, sample)
            delta.embedding = embeddings.get(request.request_id)
            deltas.append(delta)
        if self.beams.groups:
            deltas += self._resolve_beams()
        return deltas

    def _resolve_beams(self) -> list[RequestOutputDelta]:
        finished, released = self.beams.resolve()
        for beam_id in released:
            self.runner.release(beam_id)
        return [delta for group in finished for delta in beam_deltas(group)]

    def _delta(self, request: Request, sample: TokenSample) -> RequestOutputDelta:
        status = request.status
        finished = status.is_finished
        if finished:
            self.runner.release(request.request_id)
        if status == RequestStatus.FINISHED_PREFILLED:
            # In the step that finishes the prefill: the blocks go from the scheduler to a lease.
            self.leases.grant(request.request_id, LEASE, time.monotonic() + request.kv_lease_seconds)
        return RequestOutputDelta(
            request_id=request.request_id,
            new_token_ids=[sample.token_id],
            new_samples=[sample],
            finished=finished,
            finish_reason=status.value if finished else None,
            parent_request_id=request.parent_request_id,
            sample_index=request.seed_offset,
            num_prompt_tokens=len(request.prompt_token_ids),
            num_cached_tokens=request.num_cached_tokens,
            prompt_logprobs=self._first_prompt_logprobs(request),
        )

    @staticmethod
    def _first_prompt_logprobs(request: Request) -> list[TokenSample] | None:
        if request.sampling_params.prompt_logprobs is None or request.num_output_tokens != 1:
            return None
        return list(request.prompt_logprobs)

    def stats(self) -> EngineStats:
        pool = self.kv.pool
        return EngineStats(
            num_running=len(self.scheduler.running),
            num_waiting=len(self.scheduler.waiting),
            num_free_blocks=pool.num_free_blocks,
            num_total_blocks=pool.num_blocks,
            kv_cache_usage=pool.usage,
            prefix_cache_queries=pool.cache_queries,
            prefix_cache_hits=pool.cache_hits,
            num_preemptions=self.scheduler.num_preemptions,
            num_prompt_tokens_computed=self.num_prompt_tokens_computed,
            num_generation_tokens=self.num_generation_tokens,
            num_leased_requests=self.leases.num_leases,
            num_held_blocks=self.leases.num_held_blocks,
            num_leases_expired=self.leases.num_expired,
            num_pull_cached_tokens=self.kv_connector.num_local_hit_tokens,
        )


def beam_deltas(group: BeamGroup) -> list[RequestOutputDelta]:
    """One finished delta per returned hypothesis, best first, shaped like an n>1 request's children."""
    deltas = []
    for index, hypothesis in enumerate(group.results):
        deltas.append(
            RequestOutputDelta(
                request_id=group.request_id if index == 0 else f"{group.request_id}/{index}",
                new_token_ids=list(hypothesis.token_ids),
                new_samples=[
                    TokenSample(t, lp) for t, lp in zip(hypothesis.token_ids, hypothesis.logprobs, strict=True)
                ],
                finished=True,
                finish_reason=hypothesis.finish_reason,
                parent_request_id=None if index == 0 else group.request_id,
                sample_index=index,
                num_prompt_tokens=group.num_prompt_tokens,
                num_cached_tokens=group.num_cached_tokens,
            )
        )
    return deltas
