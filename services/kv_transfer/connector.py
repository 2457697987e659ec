"""Backend-agnostic KV block transfer between workers.

Each worker process wraps its paged KV cache (one contiguous tensor,
`[num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim]`, so one
block across all layers is one contiguous region) in a `KVConnector`. The
prefill side only serves reads; the decode side `add_peer`s the prefill
worker's `local_metadata()` (fetched over gRPC `GetKVMetadata`) and `pull`s
leased blocks into its own freshly allocated block ids.

Metadata envelope (JSON, versioned): the sender's `PeerInfo`, its connector
name (the peer id), its number of blocks, the bytes per block, a
backend-specific payload and, for a cache in host memory, where it lies
(`host_memory`): a peer on the same machine is then read directly from that
process's memory instead of through the backend (see host_memory).
"""

from __future__ import annotations

import base64
import dataclasses
import json
import logging
import os
import socket
import threading
import time
import uuid
import weakref
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any

import torch

from services.kv_transfer import host_memory
from services.kv_transfer.handshake import KVCompatibilityError, PeerInfo, check_peer, parse_metadata_json

logger = logging.getLogger(__name__)

METADATA_FORMAT = "cleave-kv-connector"
METADATA_VERSION = 1
DEFAULT_TIMEOUT_S = 10.0


class KVTransferError(RuntimeError):
    """A pull failed (peer gone, timeout, bad block ids); the caller recomputes or fails the request."""


@dataclass(frozen=True)
class TransferStats:
    num_bytes: int
    seconds: float
    num_descriptors: int


@dataclass(frozen=True)
class BlockRun:
    """`num_blocks` consecutive remote blocks landing in `num_blocks` consecutive local blocks."""

    remote_start: int
    local_start: int
    num_blocks: int


@dataclass(frozen=True)
class RemotePeer:
    peer_id: str
    info: PeerInfo
    num_blocks: int
    block_bytes: int
    payload: dict[str, Any]  # backend-specific
    host_memory: Any = None  # the sender's host_memory description, if any
    local: host_memory.Region | None = None  # set by add_peer where the peer is read directly


def merge_block_runs(remote_block_ids: list[int], local_block_ids: list[int]) -> list[BlockRun]:
    """Merge pairs whose remote and local ids both continue the previous pair into one run.

    >>> merge_block_runs([3, 4, 5, 9], [10, 11, 12, 0])
    [BlockRun(remote_start=3, local_start=10, num_blocks=3), BlockRun(remote_start=9, local_start=0, num_blocks=1)]
    """
    if len(remote_block_ids) != len(local_block_ids):
        raise ValueError(
            f"got {len(remote_block_ids)} remote block ids but {len(local_block_ids)} local block ids; "
            "allocate one local block per remote block"
        )
    runs: list[BlockRun] = []
    for remote_id, local_id in zip(remote_block_ids, local_block_ids, strict=True):
        if runs:
            last = runs[-1]
            if remote_id == last.remote_start + last.num_blocks and local_id == last.local_start + last.num_blocks:
                runs[-1] = BlockRun(last.remote_start, last.local_start, last.num_blocks + 1)
                continue
        runs.append(BlockRun(int(remote_id), int(local_id), 1))
    return runs


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def make_peer_info(kv_cache: torch.Tensor, *, model_id: str, role: str = "") -> PeerInfo:
    """PeerInfo describing `kv_cache` ([num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim])."""
    if kv_cache.dim() != 6 or kv_cache.shape[2] != 2:
        raise ValueError(
            f"kv_cache has shape {tuple(kv_cache.shape)}; expected "
            "[num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim]"
        )
    _, num_layers, _, block_size, num_kv_heads, head_dim = kv_cache.shape
    return PeerInfo.create(
        model_id=model_id,
        dtype=dtype_name(kv_cache.dtype),
        block_size=block_size,
        num_layers=num_layers,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        role=role,
    )


def _check_kv_cache(kv_cache: torch.Tensor, peer_info: PeerInfo) -> None:
    if not kv_cache.is_contiguous():
        raise ValueError("kv_cache must be one contiguous tensor so each block is one memory region")
    expected = make_peer_info(kv_cache, model_id=peer_info.model_id)
    if expected.compat_hash != peer_info.compat_hash:
        raise ValueError(
            f"peer_info (dtype {peer_info.dtype}, block_size {peer_info.block_size}, layers {peer_info.num_layers}, "
            f"kv heads {peer_info.num_kv_heads}, head_dim {peer_info.head_dim}) does not describe kv_cache of "
            f"shape {tuple(kv_cache.shape)} and dtype {dtype_name(kv_cache.dtype)}"
        )


def b64encode(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


def b64decode(text: str) -> bytes:
    return base64.b64decode(text.encode("ascii"))


class KVConnector(ABC):
    """One per worker process; wraps its kv_cache tensor and moves whole blocks between workers.

    Thread-safe: several pulls may run at once. Totals (`bytes_total`,
    `transfers_total`, `failures_total`, `seconds_total`) count completed and
    failed pulls for metrics export.
    """

    backend_name: str = ""

    def __init__(
        self,
        kv_cache: torch.Tensor,
        peer_info: PeerInfo,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        local_reads: bool = True,
    ) -> None:
        _check_kv_cache(kv_cache, peer_info)
        # Peers on this machine read our cache, and we theirs, straight from process memory (host_memory);
        # None where this cache cannot be read so (not in host memory, no process_vm_readv) or local_reads is off.
        self.local_reads = local_reads
        self._host_memory = host_memory.describe(kv_cache) if local_reads else None
        # Called by close; else on garbage collection, or at exit.
        self._withdraw_host_memory = weakref.finalize(self, host_memory.withdraw, self._host_memory)
        self.kv_cache = kv_cache
        self.peer_info = peer_info.with_backend(self.backend_name)
        self.timeout_s = timeout_s
        self.num_blocks = kv_cache.shape[0]
        # One block across all layers: [num_layers, 2, block_size, num_kv_heads, head_dim]
        self.block_bytes = kv_cache[0].numel() * kv_cache.element_size()
        self.name = f"{peer_info.role or 'kv'}-{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self.bytes_total = 0
        self.local_bytes_total = 0  # of bytes_total: read from a peer's process memory (host_memory)
        self.transfers_total = 0
        self.failures_total = 0
        self.seconds_total = 0.0
        self._peers: dict[str, RemotePeer] = {}
        self._lock = threading.Lock()

    # --- public interface ---------------------------------------------------------

    def local_metadata(self) -> bytes:
        """What a peer needs (via `add_peer`) to read our blocks."""
        envelope = {
            "format": METADATA_FORMAT,
            "version": METADATA_VERSION,
            "name": self.name,
            "peer_info": self.peer_info.to_dict(),
            "num_blocks": self.num_blocks,
            "block_bytes": self.block_bytes,
            "backend": self._backend_metadata(),
        }
        if self._host_memory is not None:
            envelope["host_memory"] = self._host_memory
        return json.dumps(envelope, separators=(",", ":")).encode("utf-8")

    def add_peer(self, metadata: bytes) -> str:
        """Validate a peer's metadata and make its blocks readable; returns its peer id. Idempotent."""
        peer = _decode_envelope(metadata)
        check_peer(self.peer_info, peer.info)
        if peer.block_bytes != self.block_bytes:
            raise KVCompatibilityError(
                f"peer KV blocks have {peer.block_bytes} bytes, ours {self.block_bytes}: "
                "run the same Cleave version on all workers"
            )
        with self._lock:
            if peer.peer_id in self._peers:
                return peer.peer_id
        region, why_not = self._open_local(peer)
        if region is not None:
            # Everything is read from the peer's memory: the backend never connects to it.
            peer = dataclasses.replace(peer, local=region)
        else:
            self._connect_peer(peer)
        with self._lock:
            self._peers[peer.peer_id] = peer
        logger.info(
            "kv_peer_added backend=%s peer=%s role=%s num_blocks=%d reads=%s",
            self.backend_name,
            peer.peer_id,
            peer.info.role,
            peer.num_blocks,
            "process-memory" if region is not None else f"backend ({why_not})",
        )
        return peer.peer_id

    def pull(self, peer_id: str, remote_block_ids: list[int], local_block_ids: list[int]) -> TransferStats:
        """Copy the peer's `remote_block_ids` into our `local_block_ids`; blocking.

        Raises KVTransferError on any transfer failure (and never waits longer
        than `timeout_s`), ValueError when the local block ids are invalid.
        """
        runs = merge_block_runs(remote_block_ids, local_block_ids)
        for run in runs:
            if run.local_start < 0 or run.local_start + run.num_blocks > self.num_blocks:
                raise ValueError(f"local block ids {local_block_ids} out of range [0, {self.num_blocks})")
        if not runs:
            return TransferStats(num_bytes=0, seconds=0.0, num_descriptors=0)
        num_bytes = len(remote_block_ids) * self.block_bytes
        start = time.perf_counter()
        try:
            peer = self._peer(peer_id)
            for run in runs:
                if run.remote_start < 0 or run.remote_start + run.num_blocks > peer.num_blocks:
                    raise KVTransferError(
                        f"remote block ids {remote_block_ids} out of range for peer {peer_id} "
                        f"with {peer.num_blocks} blocks"
                    )
            if peer.local is not None:
                self._read_local(peer, runs)
            else:
                self._read_runs(peer, runs)
        except KVTransferError as exc:
            with self._lock:
                self.failures_total += 1
            logger.warning("kv_pull_failed backend=%s peer=%s error=%s", self.backend_name, peer_id, exc)
            raise
        seconds = time.perf_counter() - start
        with self._lock:
            self.bytes_total += num_bytes
            if peer.local is not None:
                self.local_bytes_total += num_bytes
            self.transfers_total += 1
            self.seconds_total += seconds
        return TransferStats(num_bytes=num_bytes, seconds=seconds, num_descriptors=len(runs))

    def reads_locally(self, peer_id: str) -> bool:
        """Whether pulls from this peer read its process's memory (a peer on this machine) rather than the backend."""
        return self._peer(peer_id).local is not None

    def remove_peer(self, peer_id: str) -> bool:
        """Forget a peer (e.g. a prefill worker that left) and drop its connection; False if unknown."""
        with self._lock:
            peer = self._peers.pop(peer_id, None)
        if peer is None:
            return False
        if peer.local is None:
            self._disconnect_peer(peer)
        logger.info("kv_peer_removed backend=%s peer=%s", self.backend_name, peer_id)
        return True

    def close(self) -> None:
        """Stop serving (local readers included: the host-memory description is withdrawn) and release
        backend resources. Safe to call twice."""
        self._withdraw_host_memory()
        self._close_backend()

    def __enter__(self) -> KVConnector:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # --- backend hooks --------------------------------------------------------------

    @abstractmethod
    def _close_backend(self) -> None:
        """Stop the backend's serving and release its resources; called by `close`, possibly twice."""

    @abstractmethod
    def _backend_metadata(self) -> dict[str, Any]:
        """JSON-serialisable payload a peer's `_connect_peer` needs."""

    @abstractmethod
    def _connect_peer(self, peer: RemotePeer) -> None:
        """Prepare to read from `peer` (load agent metadata, ...); raise KVTransferError on failure."""

    @abstractmethod
    def _disconnect_peer(self, peer: RemotePeer) -> None:
        """Release what `_connect_peer` set up; never raises."""

    @abstractmethod
    def _read_runs(self, peer: RemotePeer, runs: list[BlockRun]) -> None:
        """Read every run from `peer` into the local kv_cache; raise KVTransferError on failure."""

    def _open_local(self, peer: RemotePeer) -> tuple[host_memory.Region | None, str]:
        if not self.local_reads:
            return None, "local reads off"
        if self._host_memory is None:
            return None, "this cache is not in host memory, or this machine has no process_vm_readv"
        if peer.host_memory is None:
            return None, "the peer's cache is not in host memory, or it reads through the backend only"
        region, why_not = host_memory.open_region(peer.host_memory)
        if region is not None and region.num_bytes < peer.num_blocks * peer.block_bytes:
            return None, "the peer's cache is smaller than its blocks"
        return region, why_not

    def _read_local(self, peer: RemotePeer, runs: list[BlockRun]) -> None:
        assert peer.local is not None
        base, remote, size = self.kv_cache.data_ptr(), peer.local.address, self.block_bytes
        copies = [(base + r.local_start * size, remote + r.remote_start * size, r.num_blocks * size) for r in runs]
        try:
            host_memory.read(peer.local, copies)
        except host_memory.ReadFailed as exc:
            raise KVTransferError(f"reading the KV blocks of peer {peer.peer_id} failed: {exc}") from exc

    def _peer(self, peer_id: str) -> RemotePeer:
        with self._lock:
            peer = self._peers.get(peer_id)
        if peer is None:
            raise KVTransferError(f"unknown KV peer {peer_id!r}: call add_peer with its metadata first")
        return peer


def _decode_envelope(metadata: bytes) -> RemotePeer:
    envelope = parse_metadata_json(metadata)
    if not isinstance(envelope, dict) or envelope.get("format") != METADATA_FORMAT:
        raise KVCompatibilityError("peer KV metadata is not a Cleave KV connector envelope")
    if envelope.get("version") != METADATA_VERSION:
        raise KVCompatibilityError(
            f"peer KV metadata envelope version {envelope.get('version')}, ours {METADATA_VERSION}: "
            "run the same Cleave version on all workers"
        )
    info = PeerInfo.from_dict(envelope.get("peer_info"))
    payload = envelope.get("backend")
    if not isinstance(payload, dict):
        raise KVCompatibilityError("peer KV metadata lacks its backend payload")
    try:
        return RemotePeer(
            peer_id=str(envelope["name"]),
            info=info,
            num_blocks=int(envelope["num_blocks"]),
            block_bytes=int(envelope["block_bytes"]),
            payload=payload,
            host_memory=envelope.get("host_memory"),
        )
    except (KeyError, TypeError, ValueError) as exc:
        raise KVCompatibilityError(f"peer KV metadata is malformed ({exc!r}): run the same Cleave version") from exc


def create_connector(
    kv_cache: torch.Tensor,
    peer_info: PeerInfo,
    backend: str = "auto",
    host: str = "127.0.0.1",
    timeout_s: float = DEFAULT_TIMEOUT_S,
    local_reads: bool = True,
) -> KVConnector:
    """Connector over `kv_cache`: "nixl", "tcp", or "auto" (NIXL when it imports and an agent starts, else TCP).
    With `local_reads`, peers on this machine are read from their process's memory instead (host_memory)."""
    from services.kv_transfer import nixl_backend, tcp_backend

    if backend not in ("auto", "nixl", "tcp"):
        raise ValueError(f"unknown KV transfer backend {backend!r}; choose auto, nixl or tcp")
    connector: KVConnector
    if backend in ("auto", "nixl"):
        try:
            nixl_connector = nixl_backend.NixlConnector(
                kv_cache, peer_info, timeout_s=timeout_s, local_reads=local_reads
            )
        except nixl_backend.NixlUnavailableError as exc:
            if backend == "nixl":
                raise RuntimeError(
                    f"NIXL KV transfer backend unavailable ({exc}): install nixl-cu12 (or nixl-cu13 on CUDA 13), "
                    "or start all workers with --kv-transfer-backend tcp"
                ) from exc
            logger.info("kv_transfer_backend_fallback from=nixl to=tcp reason=%r", str(exc))
        else:
            logger.info(
                "kv_transfer_backend backend=nixl name=%s module=%s", nixl_connector.name, nixl_connector.module_name
            )
            return nixl_connector
    connector = tcp_backend.TcpConnector(kv_cache, peer_info, host=host, timeout_s=timeout_s, local_reads=local_reads)
    logger.info("kv_transfer_backend backend=tcp name=%s", connector.name)
    return connector
