"""Keep large CPU allocations on the heap.

glibc serves big allocations with fresh ``mmap`` pages and returns them on
free, so every step's temporaries (gathered KV, attention scores) page-fault
anew; on CPU that costs more than the copies themselves. Raising the mmap and
trim thresholds lets freed memory be reused.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import sys

logger = logging.getLogger("cleave.engine")

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_done = False


def keep_freed_memory(mmap_threshold: int = 32 << 20, trim_threshold: int = 1 << 30) -> bool:
    """Tune glibc's malloc once per process; False where it does not apply."""
    global _done
    if _done:
        return True
    if not sys.platform.startswith("linux"):
        return False
    name = ctypes.util.find_library("c")
    if name is None:
        return False
    try:
        libc = ctypes.CDLL(name)
        ok = (
            libc.mallopt(_M_MMAP_THRESHOLD, mmap_threshold) == 1
            and libc.mallopt(_M_TRIM_THRESHOLD, trim_threshold) == 1
        )
    except (OSError, AttributeError):
        return False
    _done = ok
    logger.debug("malloc tuned mmap_threshold=%d trim_threshold=%d ok=%s", mmap_threshold, trim_threshold, ok)
    return ok
