"""Engine configuration: one frozen dataclass, every field documented once.

The CLI and the services build it from flags; every flag can also be set by a
``CLEAVE_<FLAG>`` environment variable (see ``shared.cli``).
"""

from __future__ import annotations

from dataclasses import dataclass

GiB = 1 << 30
CUDA_STEP_TOKENS = 2048
# On the CPU the budget follows the work per prompt token: as many tokens as about CPU_STEP_FLOPS of
# the decoder's projections (a power of two, 256 to 2,048), a step of about 0.2 s on two cores.
# Aborts take effect between steps, so a client that hangs up gets its blocks back within one step:
# the default SmolLM2-135M (0.21 GFLOP a token) keeps 256; the random-weight demo model (0.006 GFLOP)
# steps 2,048, and on 2 CPU cores prefills 3,315 tokens in 0.76-0.82 s with its longest step 0.42 s
# (0.83-0.96 s in 13 steps of at most 0.13 s at 256). The 12M Llama (0.019 GFLOP a token) steps
# 1,024 tokens, whose bursts of 64 reached their median first token 1-17% sooner than vLLM's server
# at its own CPU default (2,048) in four of four, where at 256 they were later in five of eight.
CPU_STEP_FLOPS = 20e9
SCHEDULING_POLICIES = ("shortest-first", "fcfs")
# Under shortest-first, a waiting request is overtaken by shorter ones that arrived after it for this long at
# most: after that it starts before them, so a long prompt under a steady stream of short ones still starts.
OVERTAKE_MAX_WAIT_S = 5.0
CPU_STEP_TOKENS = 256  # the least budget on the CPU
CPU_STEP_TOKENS_MAX = 2048


def cpu_step_tokens(layer_parameters: int) -> int:
    """The CPU token budget for a decoder whose projections hold ``layer_parameters`` weights (two
    FLOPs per weight per prompt token): the largest power of two from CPU_STEP_TOKENS to
    CPU_STEP_TOKENS_MAX whose tokens take at most CPU_STEP_FLOPS."""
    fit = CPU_STEP_FLOPS / max(1, 2 * layer_parameters)
    tokens = CPU_STEP_TOKENS
    while tokens * 2 <= min(fit, CPU_STEP_TOKENS_MAX):
        tokens *= 2
    return tokens


def default_step_tokens(device_type: str, layer_parameters: int) -> int:
    """The token budget per step where ``--max-num-batched-tokens`` is 0, on a ``device_type`` ("cuda" or
    "cpu") for a decoder whose projections hold ``layer_parameters`` weights."""
    return CUDA_STEP_TOKENS if device_type == "cuda" else cpu_step_tokens(layer_parameters)


# The float8 KV caches (vLLM's names; "fp8" is e4m3) and the torch dtype each stores: K and V rounded to nearest
# even, saturating at the format's largest value (448 for e4m3, 57344 for e5m2), without a scale.
FP8_KV_CACHE_DTYPES = {"fp8": "float8_e4m3fn", "fp8_e4m3": "float8_e4m3fn", "fp8_e5m2": "float8_e5m2"}
KV_CACHE_DTYPES = ("auto", "float32", "bfloat16", *FP8_KV_CACHE_DTYPES)


@dataclass(frozen=True)
class EngineConfig:
    model: str  # Hugging Face checkpoint directory
    dtype: str = "auto"  # "auto" (the checkpoint's, float32 on CPU for float16), "float32", "bfloat16"
    # one of KV_CACHE_DTYPES: "auto" (the model's dtype; bfloat16 where a bfloat16 checkpoint runs in float32
    # on the CPU), "float32", "bfloat16", or float8 on the CPU; see shared.engine.engine_core.resolve_kv_dtype
    kv_cache_dtype: str = "auto"
    device: str = "auto"  # "auto" (cuda when available), "cpu", "cuda"
    block_size: int = 16  # tokens per KV block
    kv_cache_memory: int = 2 * GiB  # bytes of KV cache on CPU
    kv_cache_prefault: bool = True  # CPU: make the whole cache resident at start (see allocate_kv_cache)
    gpu_memory_utilization: float = 0.9  # fraction of GPU memory for weights + KV cache on CUDA
    num_blocks: int | None = None  # overrides the memory-derived block count (tests)
    # Token budget per step; 0: CUDA_STEP_TOKENS on CUDA, cpu_step_tokens on CPU (see there).
    max_num_batched_tokens: int = 0
    max_num_seqs: int = 256  # running requests at most
    max_model_len: int | None = None  # defaults to the model's max_position_embeddings
    enable_prefix_caching: bool = True
    attention_backend: str = "auto"  # "auto", "torch", "triton"
    enforce_eager: bool = False  # CUDA only: no CUDA graphs for decode steps
    long_prefill_token_threshold: int = 0  # cap one prefill chunk (0: the whole budget)
    # The order waiting requests are admitted in: "shortest-first" (the fewest prompt tokens first, but a
    # request waiting OVERTAKE_MAX_WAIT_S or longer before any that arrived after it) or "fcfs" (arrival);
    # see shared.engine.scheduler.Scheduler.start_order
    scheduling_policy: str = "shortest-first"

    def __post_init__(self) -> None:
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two, got {self.block_size}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got {self.kv_cache_dtype!r}")
        if self.scheduling_policy not in SCHEDULING_POLICIES:
            raise ValueError(
                f"scheduling_policy must be one of {', '.join(SCHEDULING_POLICIES)}, got {self.scheduling_policy!r}"
            )
        if self.max_num_batched_tokens < 0:
            raise ValueError("max_num_batched_tokens must be >= 1, or 0 for the device's default")
        if self.max_num_seqs < 1:
            raise ValueError("max_num_seqs must be >= 1")
        if self.kv_cache_memory < 1:
            raise ValueError("kv_cache_memory must be positive")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError("gpu_memory_utilization must be in (0, 1]")
