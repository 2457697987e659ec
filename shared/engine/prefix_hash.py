"""Chained block hashes for automatic prefix caching (torch-free).

``h_i = H(h_{i-1}, tokens_i, extra)`` over full blocks only, with a stable hash
(blake2b), so the router and every worker compute the same values.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence

ROOT_HASH = b"\x00" * 16


def hash_block(parent: bytes, token_ids: Sequence[int], extra: bytes = b"") -> bytes:
    h = hashlib.blake2b(digest_size=16)
    h.update(parent)
    h.update(array("q", token_ids).tobytes())
    h.update(extra)
    return h.digest()


def block_hashes(
    token_ids: Sequence[int], block_size: int, parent: bytes = ROOT_HASH, extra: bytes = b"", start_block: int = 0
) -> list[bytes]:
    """Hashes of the full blocks of ``token_ids`` from block ``start_block`` on.

    ``parent`` must be the hash of block ``start_block - 1`` (ROOT_HASH for 0).
    """
    hashes: list[bytes] = []
    for begin in range(start_block * block_size, len(token_ids) - block_size + 1, block_size):
        parent = hash_block(parent, token_ids[begin : begin + block_size], extra)
        hashes.append(parent)
    return hashes
