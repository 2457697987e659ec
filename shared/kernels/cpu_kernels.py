"""Native CPU kernels, compiled on first use with the system C compiler.

``paged_decode`` and ``paged_prefill`` read K/V straight from the paged cache, float32,
bfloat16 or float8 (the torch path must first gather the blocks into a copy); ``paged_prefill``
applies causality per key block and shares K/V rows across a GQA group, so it
needs neither a mask nor a K/V repeat. ``write_kv`` stores new K/V rows (one memcpy
each into a float32 cache, rounded to nearest even into a bfloat16 or float8 one). ``rms_norm``
and ``rope_`` are the model's element-wise ops in one pass each (RoPE in place on the fused q|k|v output, bit-identical to torch);
``add_rms_norm_`` is a sublayer's residual add and the next norm in one pass, and
``silu_mul`` the MLP's activation on the fused gate|up output; ``linear`` is the float32 projection
(AVX-512, or AVX2 with FMA; faster than torch's BLAS at these shapes on the CPUs measured, AMD's most of all, and a row's
result does not depend on the batch around it); ``llama_forward_f32`` runs them all,
with the projections, as one call (``shared/models/cpu_stack.py``). The shared library is built once per
machine into ``$CLEAVE_CACHE_DIR`` (default ``~/.cache/cleave``), keyed by the
source and compiler flags. ``CLEAVE_CPU_KERNEL_LIB`` names a library built
ahead of time instead (the container image builds one, so it needs no compiler).
Without a compiler, or with ``CLEAVE_CPU_KERNELS=0``, ``load()`` returns None and
callers keep the torch path.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import threading
import weakref
from itertools import chain
from pathlib import Path

import numpy as np
import torch

logger = logging.getLogger("cleave.kernels")

SOURCES = sorted((Path(__file__).with_name("csrc")).glob("*.c"))
HEADERS = sorted((Path(__file__).with_name("csrc")).glob("*.h"))  # included by the sources: in the cache key
# -ffast-math lets the reductions vectorize and exp use glibc's vector variants; the
# kernel never produces infinities or NaNs (scores start from -FLT_MAX), as it assumes.
COMPILE_FLAGS = ["-O3", "-march=native", "-fopenmp", "-fPIC", "-ffast-math"]
# Linked without -ffast-math: gcc would add crtfastmath.o, whose constructor turns on
# flush-to-zero for the whole process (torch included) as soon as the library loads.
LINK_FLAGS = ["-shared", "-fopenmp"]
FLAGS = [*COMPILE_FLAGS, "|", *LINK_FLAGS]  # what the cache key describes

_lib: ctypes.CDLL | None = None
_tried = False


def _cache_dir() -> Path:
    return Path(os.environ.get("CLEAVE_CACHE_DIR") or Path.home() / ".cache" / "cleave") / "kernels"


def _cpu_fingerprint() -> str:
    """The CPU's feature flags: a library built with -march=native must not run on another CPU."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    return line
    except OSError:
        pass
    return platform.processor()


def _build(compiler: str) -> Path:
    described = " ".join([compiler, *FLAGS, platform.machine(), _cpu_fingerprint()])
    key = hashlib.sha256(b"".join(p.read_bytes() for p in [*SOURCES, *HEADERS]) + described.encode()).hexdigest()
    target = _cache_dir() / f"cpu_kernels-{key[:16]}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        built = Path(tmp) / target.name
        build_library(compiler, built)
        os.replace(built, target)  # atomic: several workers may build at once
    logger.info("cpu_kernels_built path=%s", target)
    return target


def build_library(compiler: str, output: Path, march: str = "native") -> None:
    """Compile every ``csrc/*.c`` with ``COMPILE_FLAGS`` and link them into the shared library ``output``."""
    compile_flags = [f"-march={march}" if flag.startswith("-march=") else flag for flag in COMPILE_FLAGS]
    with tempfile.TemporaryDirectory() as tmp:
        objects = [str(Path(tmp) / f"{source.stem}.o") for source in SOURCES]
        for source, obj in zip(SOURCES, objects, strict=True):
            subprocess.run([compiler, *compile_flags, "-c", str(source), "-o", obj], check=True, capture_output=True,
                           timeout=120)  # fmt: skip
        subprocess.run([compiler, *LINK_FLAGS, *objects, "-o", str(output), "-lm"], check=True, capture_output=True,
                       timeout=120)  # fmt: skip


def load() -> ctypes.CDLL | None:
    """The compiled library, or None where it cannot be built."""
    global _lib, _tried
    if _tried:
        return _lib
    _tried = True
    if os.environ.get("CLEAVE_CPU_KERNELS", "1") == "0":
        return None
    prebuilt = os.environ.get("CLEAVE_CPU_KERNEL_LIB")
    compiler = shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")
    if compiler is None and not prebuilt:
        logger.info("cpu_kernels_unavailable reason=no C compiler; using the torch attention path")
        return None
    try:
        lib = ctypes.CDLL(prebuilt or str(_build(compiler)))  # type: ignore[arg-type]
    except (OSError, subprocess.SubprocessError) as e:
        detail = getattr(e, "stderr", b"") or b""
        logger.warning("cpu_kernels_unavailable reason=%s %s", e, detail.decode(errors="replace")[:500])
        return None
    try:
        _declare(lib)
    except AttributeError as e:  # a prebuilt library from older sources
        logger.warning("cpu_kernels_unavailable reason=library lacks a kernel: %s", e)
        return None
    _lib = lib
    return lib


# The cache dtypes the attention kernels are built for (csrc/kv.h), and the suffix of each one's kernels; the
# position is the build's KV_KIND (llama_forward_f32 reads it from ForwardArgs.kv_kind).
_KV_SUFFIX = {torch.float32: "f32", torch.bfloat16: "bf16", torch.float8_e4m3fn: "e4m3", torch.float8_e5m2: "e5m2"}
KV_KIND = {dtype: kind for kind, dtype in enumerate(_KV_SUFFIX)}


def _declare(lib: ctypes.CDLL) -> None:
    ptr, i64, i32, f32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_float
    for suffix in _KV_SUFFIX.values():  # the cache's dtype; all but f32 optional: an older prebuilt library
        if suffix != "f32" and not hasattr(lib, f"paged_decode_{suffix}"):  # may lack them
            continue
        fn = getattr(lib, f"paged_decode_{suffix}")
        fn.argtypes = [ptr, ptr, ptr, ptr, i64, i64, ptr, i64, ptr, i32, i32, i32, i32, i32, f32, i32]
        fn.restype = ctypes.c_int
        fn = getattr(lib, f"paged_prefill_{suffix}")
        fn.argtypes = [ptr, ptr, ptr, ptr, i64, i64, ptr, i64, ptr, ptr, i32, i32, i32, i32, i32, f32]
        fn.restype = ctypes.c_int
        fn = getattr(lib, f"write_kv_{suffix}")
        fn.argtypes = [ptr, ptr, i64, i64, ptr, ptr, i64, i64, ptr, i32, i32, i32]
        fn.restype = None
    lib.rms_norm_f32.argtypes = [ptr, i64, ptr, ptr, i64, i32, i32, f32]
    lib.rms_norm_f32.restype = None
    lib.rope_f32.argtypes = [ptr, i64, i32, i32, i32, ptr, ptr]
    lib.rope_f32.restype = None
    lib.add_rms_norm_f32.argtypes = [ptr, i64, ptr, i64, ptr, ptr, i64, i32, i32, f32]
    lib.add_rms_norm_f32.restype = None
    lib.silu_mul_f32.argtypes = [ptr, i64, ptr, i32, i32]
    lib.silu_mul_f32.restype = None
    lib.argmax_rows_f32.argtypes = [ptr, i64, ptr, i32, i32]
    lib.argmax_rows_f32.restype = None
    lib.gather_rows_f32.argtypes = [ptr, i64, ptr, ptr, i64, i32]
    lib.gather_rows_f32.restype = i64
    if hasattr(lib, "sample_race_f32"):
        lib.sample_race_f32.argtypes = [ptr, i64, ptr, ptr, ptr, i32, i32]
        lib.sample_race_f32.restype = i32
        lib.filter_logits_f32.argtypes = [ptr, i64, ptr, ptr, ptr, i32, i32]
        lib.filter_logits_f32.restype = i32
        lib.apply_penalties_f32.argtypes = [ptr, i64, i32, i32, ptr, ptr, ptr, ptr, ptr, ptr, ptr]
        lib.apply_penalties_f32.restype = i32
        lib.logprobs_f32.argtypes = [ptr, i64, ptr, ptr, ptr, ptr, ptr, i32, i32, i32]
        lib.logprobs_f32.restype = i32
    if hasattr(lib, "linear_f32"):  # optional: an older prebuilt library keeps torch's BLAS
        lib.linear_f32.argtypes = [ptr, i64, ptr, ptr, i64, i32, i32, i32]
        lib.linear_f32.restype = None
        lib.linear_f32_available.argtypes = []
        lib.linear_f32_available.restype = ctypes.c_int
    if hasattr(lib, "linear_f32_packed"):  # likewise: without it, linear_f32 on the weights as they are
        lib.linear_f32_packed_floats.argtypes = [i32, i32]
        lib.linear_f32_packed_floats.restype = i64
        lib.linear_f32_pack.argtypes = [ptr, i32, i32, ptr]
        lib.linear_f32_pack.restype = None
        lib.linear_f32_packed.argtypes = [ptr, i64, ptr, ptr, i64, i32, i32, i32]
        lib.linear_f32_packed.restype = None
    if hasattr(lib, "linear_amx"):  # bfloat16-valued weights on AMX or AVX512-BF16 (csrc/amx.c)
        lib.linear_amx_available.argtypes = []
        lib.linear_amx_available.restype = ctypes.c_int
        lib.linear_amx.argtypes = [ptr, i64, ptr, ptr, i64, i32, i32, i32]
        lib.linear_amx.restype = ctypes.c_int
    if hasattr(lib, "linear_amx_tiles"):  # which unit runs them (a library built before the vector path: AMX)
        lib.linear_amx_tiles.argtypes = []
        lib.linear_amx_tiles.restype = ctypes.c_int
    if hasattr(lib, "linear_amx_pack"):  # built with AVX512-BF16
        lib.linear_amx_packed_elems.argtypes = [i32, i32]
        lib.linear_amx_packed_elems.restype = i64
        lib.linear_amx_pack.argtypes = [ptr, i32, i32, ptr]
        lib.linear_amx_pack.restype = None
    if hasattr(lib, "linear_amx_unpack"):  # a weight held only as its bfloat16 copy, made whole again
        lib.linear_amx_unpack.argtypes = [ptr, i32, i32, ptr]
        lib.linear_amx_unpack.restype = None
        lib.linear_amx_rows.argtypes = [ptr, i32, i32, ptr, i64, ptr]
        lib.linear_amx_rows.restype = i64
    if hasattr(lib, "pool_set_threads"):
        lib.pool_set_threads.argtypes = [i32]
        lib.pool_set_threads.restype = None
        lib.pool_set_helper_cpus.argtypes = [ptr, i32]
        lib.pool_set_helper_cpus.restype = None
        lib.pool_set_lenders.argtypes = [ptr, ptr, i32]
        lib.pool_set_lenders.restype = None
    if hasattr(lib, "pool_count_items"):  # the tests' view of the kernels' parallel loop (csrc/pool.c)
        lib.pool_count_items.argtypes = [i64, i64, ptr]
        lib.pool_count_items.restype = None
        lib.pool_record_cpus.argtypes = [i64, i64, ptr]
        lib.pool_record_cpus.restype = None
        lib.pool_record_cpus_lender_back.argtypes = [i64, i64, ptr, ptr, i64, ptr]
        lib.pool_record_cpus_lender_back.restype = None


def kv_cache_supported(dtype: torch.dtype) -> bool:
    """The attention kernels read a cache of this dtype (float32; bfloat16 or float8 from a library that has them)."""
    lib = load()
    return lib is not None and dtype in _KV_SUFFIX and hasattr(lib, f"paged_decode_{_KV_SUFFIX[dtype]}")


def _kv_kernel(name: str, cache: torch.Tensor):
    """The kernel ``name`` built for ``cache``'s dtype."""
    return getattr(load(), f"{name}_{_KV_SUFFIX[cache.dtype]}")


def supports(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> bool:
    """float32 queries over a float32, bfloat16 or float8 cache."""
    head_dim = k_cache.shape[3]
    return (
        query.device.type == "cpu"
        and query.dtype == torch.float32
        and k_cache.dtype == v_cache.dtype
        and kv_cache_supported(k_cache.dtype)
        and k_cache.stride() == v_cache.stride()
        and k_cache.stride()[2:] == (head_dim, 1)
    )


def paged_decode(
    query: torch.Tensor,  # [num_seqs, num_heads, head_dim] float32
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim], strided layer view
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [num_seqs, max_blocks] int32
    seq_lens: list[int],
    scale: float,
) -> torch.Tensor | None:  # [num_seqs, num_heads, head_dim], or None if the kernel declined
    query = query.contiguous()
    block_tables = block_tables.to(torch.int32).contiguous()
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    out = torch.empty_like(query)
    num_seqs, num_heads, head_dim = query.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    status = _kv_kernel("paged_decode", k_cache)(
        query.data_ptr(), out.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), k_cache.stride(0),
        k_cache.stride(1), block_tables.data_ptr(), block_tables.stride(0), lens.data_ptr(), num_seqs, num_heads,
        num_kv_heads, head_dim, block_size, scale, max(seq_lens),
    )  # fmt: skip
    return out if status == 0 else None


def paged_prefill(
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim] float32
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim], strided layer view
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [num_seqs, max_blocks] int32
    query_start_loc: torch.Tensor,  # [num_seqs + 1] int32, on the CPU
    seq_lens: torch.Tensor,  # [num_seqs] int32, on the CPU
    scale: float,
) -> torch.Tensor | None:  # [num_tokens, num_heads, head_dim], or None if the kernel declined
    """Causal attention of every sequence's new tokens (any count, decode included) over its paged context."""
    query = query.contiguous()
    block_tables = block_tables.to(torch.int32).contiguous()
    query_start_loc = query_start_loc.to(torch.int32).contiguous()
    seq_lens = seq_lens.to(torch.int32).contiguous()
    out = torch.empty_like(query)
    _, num_heads, head_dim = query.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    status = _kv_kernel("paged_prefill", k_cache)(
        query.data_ptr(), out.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), k_cache.stride(0),
        k_cache.stride(1), block_tables.data_ptr(), block_tables.stride(0), query_start_loc.data_ptr(),
        seq_lens.data_ptr(), seq_lens.shape[0], num_heads, num_kv_heads, head_dim, block_size, scale,
    )  # fmt: skip
    return out if status == 0 else None


def supports_write(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> bool:
    """float32 rows of K/V (inner two dims contiguous) going into float32, bfloat16 or float8 caches of one layout."""
    head_dim = k_cache.shape[3]
    rows_ok = all(t.stride()[1:] == (head_dim, 1) for t in (key, value))
    return (
        key.dtype == value.dtype == torch.float32
        and k_cache.dtype == v_cache.dtype
        and kv_cache_supported(k_cache.dtype)
        and key.device.type == "cpu"
        and rows_ok
        and k_cache.stride() == v_cache.stride()
        and k_cache.stride()[2:] == (head_dim, 1)
    )


def write_kv(
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim], rows may be strided
    value: torch.Tensor,
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim], strided layer view
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # [num_tokens] int64
) -> None:
    slot_mapping = slot_mapping.to(torch.int64).contiguous()
    _, block_size, num_kv_heads, head_dim = k_cache.shape
    _kv_kernel("write_kv", k_cache)(
        key.data_ptr(), value.data_ptr(), key.stride(0), value.stride(0), k_cache.data_ptr(), v_cache.data_ptr(),
        k_cache.stride(0), k_cache.stride(1), slot_mapping.data_ptr(), key.shape[0], num_kv_heads * head_dim,
        block_size,
    )  # fmt: skip


def _f32_rows(*tensors: torch.Tensor) -> bool:
    """float32 CPU matrices whose rows are contiguous."""
    return all(t.dim() == 2 and t.dtype == torch.float32 and t.device.type == "cpu" and t.stride(1) == 1
               for t in tensors)  # fmt: skip


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor | None:
    """``weight * x / sqrt(mean(x^2) + eps)`` per row of ``x`` [rows, size]; None where it does not apply."""
    if not (_f32_rows(x) and weight.dtype == torch.float32 and weight.is_contiguous() and load() is not None):
        return None
    lib = load()
    assert lib is not None
    out = torch.empty_like(x, memory_format=torch.contiguous_format)
    lib.rms_norm_f32(x.data_ptr(), x.stride(0), weight.data_ptr(), out.data_ptr(), out.stride(0), x.shape[0],
                     x.shape[1], eps)  # fmt: skip
    return out


def fuses_residual(hidden: torch.Tensor) -> bool:
    """Whether the model can run its residual adds fused into its norms (``add_rms_norm_``) on ``hidden``."""
    return _f32_rows(hidden) and load() is not None


def add_rms_norm_(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> torch.Tensor | None:  # [rows, size]
    """``residual += x`` in place, then ``rms_norm(residual)``; None (nothing changed) where it does not apply."""
    if not (_f32_rows(x, residual) and x.shape == residual.shape and weight.dtype == torch.float32
            and weight.is_contiguous() and load() is not None):  # fmt: skip
        return None
    lib = load()
    assert lib is not None
    out = torch.empty(x.shape, dtype=x.dtype)
    lib.add_rms_norm_f32(x.data_ptr(), x.stride(0), residual.data_ptr(), residual.stride(0), weight.data_ptr(),
                         out.data_ptr(), out.stride(0), x.shape[0], x.shape[1], eps)  # fmt: skip
    return out


def silu_mul(gate_up: torch.Tensor, size: int) -> torch.Tensor | None:  # [rows, size]
    """``silu(gate_up[:, :size]) * gate_up[:, size:2 * size]`` in one pass; None where it does not apply."""
    if not (_f32_rows(gate_up) and gate_up.shape[1] >= 2 * size and load() is not None):
        return None
    lib = load()
    assert lib is not None
    out = torch.empty(gate_up.shape[0], size, dtype=gate_up.dtype)
    lib.silu_mul_f32(gate_up.data_ptr(), gate_up.stride(0), out.data_ptr(), gate_up.shape[0], size)
    return out


def argmax(x: torch.Tensor) -> torch.Tensor | None:  # [rows, n] -> [rows] int64
    """``x.max(dim=-1).indices`` (the first largest value of each row, or its first NaN) in one vectorised
    pass per row; None where it does not apply."""
    if not (_f32_rows(x) and x.shape[1] > 0 and load() is not None):
        return None
    lib = load()
    assert lib is not None
    out = torch.empty(x.shape[0], dtype=torch.int64)
    lib.argmax_rows_f32(x.data_ptr(), x.stride(0), out.data_ptr(), x.shape[0], x.shape[1])
    return out


def sample_race(logits: torch.Tensor, temperature: torch.Tensor, keys: torch.Tensor) -> torch.Tensor | None:
    """Per row of ``logits`` [rows, n], a token drawn from ``softmax(logits / temperature)`` ([rows], > 0) by
    the exponential race, its noise derived from the row's int64 key alone (``csrc/sample.c``): [rows]
    int64. None where it does not apply."""
    lib = load()
    if not (_f32_rows(logits) and logits.shape[1] > 0 and lib is not None and hasattr(lib, "sample_race_f32")):
        return None
    inverse = (1.0 / temperature.to(torch.float32)).contiguous()
    keys = keys.to(torch.int64).contiguous()
    out = torch.empty(logits.shape[0], dtype=torch.int64)
    if lib.sample_race_f32(logits.data_ptr(), logits.stride(0), inverse.data_ptr(), keys.data_ptr(), out.data_ptr(),
                           logits.shape[0], logits.shape[1]) != 0:  # fmt: skip
        return None
    return out


def filter_logits_(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, min_p: torch.Tensor) -> bool:
    """In place on ``logits`` [rows, n]: top-k (0: off), top-p (1: off), then min-p (0: off) per row, the
    tokens outside set to -inf, as ``sampler.apply_top_k``, ``apply_top_p`` and ``apply_min_p`` (ties at
    the boundaries kept) without sorting the vocabulary (``csrc/sample.c``). False where it does not
    apply (``logits`` then untouched)."""
    lib = load()
    if not (_f32_rows(logits) and logits.shape[1] > 0 and lib is not None and hasattr(lib, "filter_logits_f32")):
        return False
    top_k = top_k.to(torch.int64).contiguous()
    top_p, min_p = (t.to(torch.float32).contiguous() for t in (top_p, min_p))
    status = lib.filter_logits_f32(logits.data_ptr(), logits.stride(0), top_k.data_ptr(), top_p.data_ptr(),
                                   min_p.data_ptr(), logits.shape[0], logits.shape[1])  # fmt: skip
    return status == 0


def logprobs(
    logits: torch.Tensor, token_ids: torch.Tensor, num_top: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """Per row of ``logits`` [rows, n]: the logprob of ``token_ids`` [rows], and the ``num_top`` most likely
    tokens [rows, num_top] with their logprobs (descending; the lower id first among ties), as
    ``log_softmax`` then ``topk`` give them, without sorting the vocabulary (``csrc/sample.c``). None where
    it does not apply."""
    scored = _logprobs(logits, token_ids, num_top, ranks=False)
    return None if scored is None else scored[:3]


def prompt_logprobs(
    logits: torch.Tensor, token_ids: torch.Tensor, num_top: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """As ``logprobs``, plus each token's rank [rows] (int64): 1 + the number of tokens with a larger logit.
    Returns (logprobs, ranks, top ids, top logprobs); None where it does not apply."""
    scored = _logprobs(logits, token_ids, num_top, ranks=True)
    if scored is None:
        return None
    chosen, top_ids, top_logprobs, ranks = scored
    assert ranks is not None
    return chosen, ranks, top_ids, top_logprobs


def _logprobs(
    logits: torch.Tensor, token_ids: torch.Tensor, num_top: int, ranks: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None] | None:
    lib = load()
    if not (_f32_rows(logits) and 0 <= num_top <= min(64, logits.shape[1]) and lib is not None
            and hasattr(lib, "logprobs_f32")):  # fmt: skip
        return None
    rows = logits.shape[0]
    token_ids = token_ids.to(torch.int64).contiguous()
    chosen = torch.empty(rows, dtype=torch.float32)
    top_ids = torch.empty(rows, num_top, dtype=torch.int64)
    top_logprobs = torch.empty(rows, num_top, dtype=torch.float32)
    rank = torch.empty(rows, dtype=torch.int64) if ranks else None
    status = lib.logprobs_f32(logits.data_ptr(), logits.stride(0), token_ids.data_ptr(), chosen.data_ptr(),
                              top_ids.data_ptr(), top_logprobs.data_ptr(), None if rank is None else rank.data_ptr(),
                              rows, logits.shape[1], num_top)  # fmt: skip
    return (chosen, top_ids, top_logprobs, rank) if status == 0 else None


def _flat_ids(rows: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """Every row's ids in one int64 tensor, and the [rows + 1] offsets where each row's start."""
    offsets = np.zeros(len(rows) + 1, dtype=np.int64)
    np.cumsum([len(r) for r in rows], out=offsets[1:])
    ids = np.fromiter(chain.from_iterable(rows), dtype=np.int64, count=int(offsets[-1]))  # a list of ints fastest
    return torch.from_numpy(ids), torch.from_numpy(offsets)


def apply_penalties_(
    logits: torch.Tensor,  # [rows, n] float32, penalised in place
    prompt_ids: list[list[int]],
    output_ids: list[list[int]],
    repetition: torch.Tensor,  # [rows], 1: off
    frequency: torch.Tensor,  # [rows], 0: off
    presence: torch.Tensor,  # [rows], 0: off
) -> bool:
    """HF's repetition penalty on each row's prompt and output tokens, then OpenAI's frequency and presence
    penalties on its output tokens, touching only those tokens (``csrc/sample.c``): the same values as
    the sampler's [rows, n] count tensors give. False where it does not apply (``logits`` untouched)."""
    lib = load()
    if not (_f32_rows(logits) and lib is not None and hasattr(lib, "apply_penalties_f32")):
        return False
    repeats = bool((repetition != 1.0).any())
    prompt, prompt_offsets = _flat_ids(prompt_ids if repeats else [[] for _ in prompt_ids])
    output, output_offsets = _flat_ids(output_ids)
    penalties = [t.to(torch.float32).contiguous() for t in (repetition, frequency, presence)]
    status = lib.apply_penalties_f32(logits.data_ptr(), logits.stride(0), logits.shape[0], logits.shape[1],
                                     prompt.data_ptr(), prompt_offsets.data_ptr(), output.data_ptr(),
                                     output_offsets.data_ptr(), *(t.data_ptr() for t in penalties))  # fmt: skip
    return status == 0


def gather_rows(table: torch.Tensor, ids: torch.Tensor) -> torch.Tensor | None:  # [N, D], [T] -> [T, D]
    """``table[ids]`` (an embedding lookup) on the calling thread, also from a table held as its bfloat16
    copy (``hold_as_bfloat16``); None where it does not apply. An id outside the table
    raises IndexError, as torch's lookup does."""
    held = held_shape(table)
    if not ((held is not None or (_f32_rows(table) and table.is_contiguous())) and ids.dim() == 1
            and ids.dtype == torch.int64 and ids.device.type == "cpu" and load() is not None):  # fmt: skip
        return None
    lib = load()
    assert lib is not None
    ids = ids.contiguous()
    rows, dim = projection_shape(table)
    out = torch.empty(ids.shape[0], dim, dtype=torch.float32)
    if held is not None:
        bad = lib.linear_amx_rows(table.data_ptr(), rows, dim, ids.data_ptr(), ids.shape[0], out.data_ptr())
    else:
        bad = lib.gather_rows_f32(table.data_ptr(), rows, ids.data_ptr(), out.data_ptr(), ids.shape[0], dim)
    if bad >= 0:
        raise IndexError(f"index {int(ids[bad])} is out of range for {rows} rows")
    return out


def native_linear() -> bool:
    """Whether float32 CPU projections run on this library's ``linear_f32`` (built with AVX-512 or AVX2+FMA)
    instead of torch's BLAS; ``CLEAVE_CPU_GEMM=blas`` keeps the BLAS. Checked once per process."""
    global _native_linear
    if _native_linear is None:
        _native_linear = _kernel_runs("linear_f32", "CLEAVE_CPU_GEMM", "blas")
    return _native_linear


def _kernel_runs(name: str, switch: str, off: str) -> bool:
    """The library has kernel ``name``, its ``name_available()`` says it runs here, and ``$switch`` is not
    ``off``."""
    lib = load()
    return (
        lib is not None
        and os.environ.get(switch, "") != off
        and hasattr(lib, name)
        and getattr(lib, f"{name}_available")() == 1
    )


_native_linear: bool | None = None


_packing_enabled = os.environ.get("CLEAVE_PACKED_WEIGHTS", "1") != "0"
PACKED_ATTR = "_cleave_packed"  # on a weight tensor: (data_ptr, version, packed copy or None: not packed)
# The packed copies a process holds take at most this share of the memory they could have taken (what
# the kernel reports available plus the copies already made): a model that fits the machine must not stop
# fitting for a faster product, and a model of many weights must not pack itself, one weight at a time,
# into the last free megabytes (nor two workers starting side by side into each other's). The weights left
# unpacked run on linear_f32 (their rows stay batch-invariant: the choice is made once per weight).
PACK_MEMORY_SHARE = 0.25
_refusals_logged = False
_packed_bytes = 0  # held by this process's live packed copies
_packed_lock = threading.Lock()


def _packed_copy_freed(nbytes: int) -> None:
    global _packed_bytes
    with _packed_lock:
        _packed_bytes -= nbytes


def available_memory_bytes() -> int | None:
    """``MemAvailable`` from ``/proc/meminfo``, or None where the kernel does not say."""
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def packed_weight(weight: torch.Tensor) -> torch.Tensor | None:
    """The packed copy of a float32 CPU ``weight`` [N, K] that the AVX-512 kernel reads (``csrc/gemm.c``:
    panels of 32 columns, k-major), made on first use and kept on the tensor; made again once the weight
    is written in place (its version moves) or its storage changes. None where the library has no packed
    kernel (AVX2 builds), ``CLEAVE_PACKED_WEIGHTS=0``, or where the process's copies would then take more
    than ``PACK_MEMORY_SHARE`` of the memory they could take: ``linear`` then reads the weight as it is.
    Costs one more copy of the weight."""
    key = (weight.data_ptr(), weight._version)
    cached = getattr(weight, PACKED_ATTR, None)  # first: every projection of every step asks
    if cached is not None and (cached[:2] == key or cached[2] is None):
        return cached[2]  # None: refused once, stays on linear_f32 so that its results do not change
    lib = load()
    if lib is None or not hasattr(lib, "linear_f32_packed") or not native_linear() or not _packing_enabled:
        return None
    n, k = weight.shape
    floats = lib.linear_f32_packed_floats(n, k)
    if floats <= 0:  # no packed kernel in this build: asked once per weight
        setattr(weight, PACKED_ATTR, (*key, None))
        return None
    packed = _weight_copy(floats, torch.float32, tuple(weight.shape))
    if packed is not None:
        lib.linear_f32_pack(weight.data_ptr(), n, k, packed.data_ptr())
    setattr(weight, PACKED_ATTR, (*key, packed))
    return packed


def _weight_copy(count: int, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor | None:
    """An empty tensor for a kernel's copy of a weight, counted against ``PACK_MEMORY_SHARE`` until it is
    freed; None (logged once) where it does not fit."""
    global _packed_bytes, _refusals_logged
    nbytes = count * torch.tensor([], dtype=dtype).element_size()
    available = available_memory_bytes()
    with _packed_lock:
        held = _packed_bytes
        fits = available is None or held + nbytes <= PACK_MEMORY_SHARE * (available + held)
        if fits:
            _packed_bytes += nbytes
    if not fits:
        if not _refusals_logged:
            _refusals_logged = True
            logger.warning("packed_weights_refused shape=%s bytes=%d available=%d packed=%d: this weight and any "
                           "other that does not fit keep the unpacked projection", shape, nbytes, available,
                           held)  # fmt: skip
        return None
    copy = torch.empty(count, dtype=dtype)  # CPU tensors start 64-byte aligned, as the kernels load
    weakref.finalize(copy, _packed_copy_freed, nbytes)
    assert copy.data_ptr() % 64 == 0
    return copy


BF16_ATTR = "_cleave_bf16_values"  # on a float32 weight: its values are bfloat16 ones (mark_bfloat16_values)
AMX_ATTR = "_cleave_amx"  # on such a weight: (data_ptr, version, its AMX copy)
_amx: bool | None = None


def amx() -> bool:
    """Whether projections of bfloat16-valued weights run on their bfloat16 copy (``csrc/amx.c``): on AMX
    where the CPU has it and the kernel grants it, else on AVX512-BF16's dot products (built with it), and
    not turned off with ``CLEAVE_CPU_AMX=0``. Checked once per process."""
    global _amx
    if _amx is None:
        _amx = _kernel_runs("linear_amx", "CLEAVE_CPU_AMX", "0")
    return _amx


def amx_unit() -> str | None:
    """What runs ``amx``'s projections: ``"amx"`` (the tile unit) or ``"avx512_bf16"`` (vector dot products);
    None where they stay on the float32 kernel."""
    if not amx():
        return None
    lib = load()
    assert lib is not None
    tiles = getattr(lib, "linear_amx_tiles", None)
    return "amx" if tiles is None or tiles() else "avx512_bf16"


def mark_bfloat16_values(weights: list[torch.Tensor]) -> None:
    """Say that these float32 weights hold bfloat16 values (a bfloat16 checkpoint loaded in float32): their
    projections may then run on AMX or AVX512-BF16 (``amx``), which round the activations to bfloat16 as a
    bfloat16 model does."""
    for weight in weights:
        setattr(weight, BF16_ATTR, True)


HELD_ATTR = "_cleave_bf16_held"  # on a weight held only as its bfloat16 copy (hold_as_bfloat16): its [N, K]


def bfloat16_holding() -> bool:
    """Whether projections of bfloat16 values can be held as their bfloat16 copies alone (``hold_as_bfloat16``):
    ``amx`` runs them, on the native linear kernel, and the library can unpack a copy where a caller needs the
    float32 values."""
    lib = load()
    return amx() and native_linear() and lib is not None and hasattr(lib, "linear_amx_unpack")


def held_shape(weight: torch.Tensor) -> tuple[int, int] | None:
    """The [N, K] of a weight held only as its bfloat16 copy; None for any other tensor."""
    return getattr(weight, HELD_ATTR, None)


def projection_shape(weight: torch.Tensor) -> tuple[int, int]:
    """A projection weight's [N, K], whether it is a matrix or held as its bfloat16 copy."""
    held = held_shape(weight)
    return held if held is not None else (weight.shape[0], weight.shape[1])


def hold_as_bfloat16(weight: torch.Tensor) -> None:
    """Give a float32 CPU projection ``weight`` [N, K] (a parameter, before its values are loaded) the storage
    of its bfloat16 copy in place of its own: 2 bytes a value instead of 4 for the matrix plus 2 for the copy.
    ``linear`` and the one-call forward read it as any bfloat16 copy (``amx_weight`` returns the weight itself);
    its values arrive through ``BFloat16Staging``. Only where ``bfloat16_holding``."""
    lib = load()
    assert lib is not None and bfloat16_holding() and weight.dtype == torch.float32 and weight.dim() == 2
    n, k = weight.shape
    weight.data = torch.empty(lib.linear_amx_packed_elems(n, k), dtype=torch.bfloat16, device="cpu")  # the bits
    setattr(weight, HELD_ATTR, (n, k))


def unpacked(weight: torch.Tensor) -> torch.Tensor:
    """The float32 [N, K] values of a weight held as its bfloat16 copy (a new tensor: for the rare caller that
    cannot read the copy)."""
    held, lib = held_shape(weight), load()
    assert lib is not None and held is not None
    n, k = held
    values = torch.empty(n, k, dtype=torch.float32)
    lib.linear_amx_unpack(weight.data_ptr(), n, k, values.data_ptr())
    return values


class BFloat16Staging:
    """The float32 rows of a weight held as its bfloat16 copy while a loader fills them, slice by slice
    (``rows``): once every row has arrived they are rounded to bfloat16 into the copy and freed, so a load holds
    at most one weight's float32 values at a time."""

    def __init__(self, weight: torch.Tensor) -> None:
        self.weight = weight
        self.n, self.k = projection_shape(weight)
        self.values: torch.Tensor | None = None
        self.arrived: dict[int, int] = {}  # first row -> rows, of every slice copied so far

    def rows(self, start: int, count: int) -> StagedRows:
        return StagedRows(self, start, count)

    def fill(self, start: int, src: torch.Tensor) -> None:
        if self.values is None:
            self.values = torch.empty(self.n, self.k, dtype=torch.float32)
        self.values[start : start + src.shape[0]].copy_(src)
        self.arrived[start] = src.shape[0]
        if sum(self.arrived.values()) == self.n:
            lib = load()
            assert lib is not None
            lib.linear_amx_pack(self.values.data_ptr(), self.n, self.k, self.weight.data_ptr())
            self.values = None


class StagedRows:
    """Rows [start, start + count) of a ``BFloat16Staging``: what a loader copies a checkpoint tensor into
    (``shape`` and ``copy_``, as the destination view of a matrix weight)."""

    def __init__(self, staging: BFloat16Staging, start: int, count: int) -> None:
        self.staging, self.start = staging, start
        self.shape = torch.Size([count, staging.k])

    def copy_(self, src: torch.Tensor) -> StagedRows:
        if tuple(src.shape) != tuple(self.shape):
            raise ValueError(f"expected rows of shape {tuple(self.shape)}, got {tuple(src.shape)}")
        self.staging.fill(self.start, src)
        return self


def amx_weight(weight: torch.Tensor) -> torch.Tensor | None:
    """The bfloat16 copy of a bfloat16-valued float32 CPU ``weight`` [N, K] (half its bytes) that AMX and
    AVX512-BF16 read (``amx``), made on first use
    and kept on the tensor (made again once it is written in place); None where AMX does not apply, or where
    the copy would not fit in ``PACK_MEMORY_SHARE`` (as for ``packed_weight``). A weight held as its copy
    (``hold_as_bfloat16``) is its own."""
    if held_shape(weight) is not None:
        return weight
    if not getattr(weight, BF16_ATTR, False) or not amx():
        return None
    key = (weight.data_ptr(), weight._version)
    cached = getattr(weight, AMX_ATTR, None)
    if cached is not None and (cached[:2] == key or cached[2] is None):
        return cached[2]  # None: did not fit once, stays on the float32 kernel so that its results do not change
    lib = load()
    assert lib is not None
    n, k = weight.shape
    packed = _weight_copy(lib.linear_amx_packed_elems(n, k), torch.int16, tuple(weight.shape))
    if packed is not None:
        lib.linear_amx_pack(weight.data_ptr(), n, k, packed.data_ptr())
    setattr(weight, AMX_ATTR, (*key, packed))
    return packed


def kernel_copies(weight: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """(bfloat16 copy, packed float32 copy) of a projection's weight, at most one of them, made on first use:
    the bfloat16 one where it applies (``amx_weight``), else the packed one (``packed_weight``); neither: the
    weight as it is. The module path (``linear``) and the one-call forward (``CpuStack``) both choose here."""
    tiles = amx_weight(weight)
    return (tiles, None) if tiles is not None else (None, packed_weight(weight))


def linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor | None:
    """``x @ weight.T`` for float32 CPU ``x`` [..., K] and ``weight`` [N, K] (or held as its bfloat16 copy) on
    the native kernel, whose result for a row does not depend on the other rows; None where it does not apply
    (never for a held weight, which nothing else can multiply)."""
    held = held_shape(weight)
    if held is None and not (weight.dtype == torch.float32 and weight.device.type == "cpu" and weight.dim() == 2
                             and weight.is_contiguous()):  # fmt: skip
        return None
    n, k = projection_shape(weight)
    if not (x.dtype == torch.float32 and x.device.type == "cpu" and x.shape[-1] == k and native_linear()):
        if held is not None:
            raise ValueError(f"a projection held as its bfloat16 copy takes float32 CPU rows of {k} values, "
                             f"not {x.dtype} {tuple(x.shape)} on {x.device}")  # fmt: skip
        return None
    rows = x.reshape(-1, k)
    if rows.stride(-1) != 1 or (rows.shape[0] > 1 and rows.stride(0) < rows.shape[1]):
        rows = rows.contiguous()
    out = torch.empty(*x.shape[:-1], n, dtype=torch.float32)
    lib = load()
    assert lib is not None
    tiles, packed = kernel_copies(weight)
    if tiles is not None:
        status = lib.linear_amx(rows.data_ptr(), rows.stride(0), tiles.data_ptr(), out.data_ptr(), n,
                                rows.shape[0], n, k)  # fmt: skip
        if status == 0:
            return out
    # no copy, or no memory for the rounded rows: the weight's float32 values, as the one-call forward does
    product, w = (lib.linear_f32_packed, packed) if packed is not None else (lib.linear_f32, weight)
    if held is not None:
        w = unpacked(weight)
    product(rows.data_ptr(), rows.stride(0), w.data_ptr(), out.data_ptr(), n, rows.shape[0], n, k)
    return out


def rope_(
    qk: torch.Tensor,  # [num_tokens, >= num_heads_total * head_dim] float32, rows contiguous
    num_heads_total: int,
    cos: torch.Tensor,  # [num_tokens, head_dim] float32, contiguous
    sin: torch.Tensor,
) -> bool:
    """Rotates the first ``num_heads_total`` heads of every row in place; False where it does not apply."""
    head_dim = cos.shape[-1]
    fits = qk.shape[1] >= num_heads_total * head_dim and qk.shape[0] == cos.shape[0] == sin.shape[0]
    if not (fits and _f32_rows(qk, cos, sin) and cos.is_contiguous() and sin.is_contiguous() and load() is not None):
        return False
    lib = load()
    assert lib is not None
    lib.rope_f32(qk.data_ptr(), qk.stride(0), qk.shape[0], num_heads_total, head_dim, cos.data_ptr(), sin.data_ptr())
    return True


if __name__ == "__main__":  # the image's build stage: python -m shared.kernels.cpu_kernels OUT [--march M]
    import argparse

    parser = argparse.ArgumentParser(description="build the native CPU kernels into one shared library")
    parser.add_argument("output", type=Path)
    parser.add_argument("--march", default="native", help="gcc -march value (the image builds for a baseline CPU)")
    parser.add_argument("--cc", default=os.environ.get("CC", "gcc"))
    cli = parser.parse_args()
    build_library(cli.cc, cli.output, cli.march)
