"""CPU memory: keep large allocations on the heap; back the KV cache and the
weights with huge pages.

glibc serves big allocations with fresh ``mmap`` pages and returns them on
free, so every step's temporaries (gathered KV, attention scores) page-fault
anew; on CPU that costs more than the copies themselves. Raising the mmap and
trim thresholds lets freed memory be reused.

A decode step reads the weights and the whole live KV cache, scattered over
blocks: with 4 KiB pages that is a TLB miss every 4 KiB and a hardware
prefetcher that stops at every page edge. ``huge_page_mapping`` gives an
anonymous mapping aligned to 2 MiB and advised for transparent huge pages
(Linux kernels commonly enable them only where advised).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import mmap
import os
import sys

from shared.flags import FALSE_WORDS

logger = logging.getLogger("cleave.engine")

HUGE_PAGE_BYTES = 2 << 20
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


def huge_pages_enabled() -> bool:
    """``CLEAVE_HUGE_PAGES=0`` keeps ordinary pages."""
    return (os.environ.get("CLEAVE_HUGE_PAGES") or "1").lower() not in FALSE_WORDS  # unset or empty: on


def huge_page_mapping(num_bytes: int) -> tuple[mmap.mmap, int]:
    """An anonymous, zeroed mapping holding ``num_bytes`` from the returned offset, which is 2 MiB aligned
    and advised for transparent huge pages where the platform has them. Pages are supplied on first touch."""
    advise = huge_pages_enabled() and hasattr(mmap, "MADV_HUGEPAGE")
    extra = HUGE_PAGE_BYTES if advise else 0
    buffer = mmap.mmap(-1, num_bytes + extra, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if not advise:
        return buffer, 0
    address = ctypes.addressof(ctypes.c_char.from_buffer(buffer))
    offset = -address % HUGE_PAGE_BYTES
    try:
        buffer.madvise(mmap.MADV_HUGEPAGE, offset, num_bytes + extra - offset)
    except OSError as e:  # e.g. a kernel built without transparent huge pages
        logger.debug("madvise(MADV_HUGEPAGE) failed: %s", e)
    return buffer, offset
