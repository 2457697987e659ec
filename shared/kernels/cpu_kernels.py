"""Native CPU kernels, compiled on first use with the system C compiler.

``paged_decode`` reads K/V straight from the paged cache (the torch path must
first gather the blocks into a copy). The shared library is built once per
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
from pathlib import Path

import torch

logger = logging.getLogger("cleave.kernels")

SOURCE = Path(__file__).with_name("csrc") / "paged_decode.c"
# -ffast-math lets the reductions vectorize and exp use glibc's vector variants; the
# kernel never produces infinities or NaNs (scores start from -FLT_MAX), as it assumes.
FLAGS = ["-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-ffast-math"]

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
    key = hashlib.sha256(SOURCE.read_bytes() + described.encode()).hexdigest()
    target = _cache_dir() / f"paged_decode-{key[:16]}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        built = Path(tmp) / target.name
        subprocess.run([compiler, *FLAGS, str(SOURCE), "-o", str(built), "-lm"], check=True, capture_output=True,
                       timeout=120)  # fmt: skip
        os.replace(built, target)  # atomic: several workers may build at once
    logger.info("cpu_kernels_built path=%s", target)
    return target


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
    fn = lib.paged_decode_f32
    ptr, i64, i32, f32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_float
    fn.argtypes = [ptr, ptr, ptr, ptr, i64, i64, ptr, i64, ptr, i32, i32, i32, i32, i32, f32, i32]
    fn.restype = ctypes.c_int
    _lib = lib
    return lib


def supports(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> bool:
    head_dim = k_cache.shape[3]
    return (
        query.device.type == "cpu"
        and query.dtype == k_cache.dtype == v_cache.dtype == torch.float32
        and k_cache.stride() == v_cache.stride()
        and k_cache.stride()[2:] == (head_dim, 1)
        and load() is not None
    )


def paged_decode(
    query: torch.Tensor,  # [num_seqs, num_heads, head_dim] float32
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim], strided layer view
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [num_seqs, max_blocks] int32
    seq_lens: list[int],
    scale: float,
) -> torch.Tensor | None:  # [num_seqs, num_heads, head_dim], or None if the kernel declined
    lib = load()
    assert lib is not None
    query = query.contiguous()
    block_tables = block_tables.to(torch.int32).contiguous()
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    out = torch.empty_like(query)
    num_seqs, num_heads, head_dim = query.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    status = lib.paged_decode_f32(
        query.data_ptr(), out.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), k_cache.stride(0),
        k_cache.stride(1), block_tables.data_ptr(), block_tables.stride(0), lens.data_ptr(), num_seqs, num_heads,
        num_kv_heads, head_dim, block_size, scale, max(seq_lens),
    )  # fmt: skip
    return out if status == 0 else None
