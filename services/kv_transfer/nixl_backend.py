"""NIXL (UCX) KV connector: the decode side issues one-sided READs of the prefill side's blocks.

Each connector owns one NIXL agent with the UCX backend and registers its whole
kv_cache (DRAM for CPU tensors, VRAM for CUDA tensors). Its metadata carries
the agent metadata plus the base address of the cache; with the block size in
bytes a peer can address any block. A pull is one READ transfer of all merged
descriptors, polled to completion or until the connector's timeout.

UCX reads its transport list from the environment when the agent starts. If
`UCX_TLS` is unset we set it to `tcp`: on the machines Cleave targets UCX's
shared-memory transports fail, and tcp is also the path UCX takes to VRAM
there. Operators with RDMA hardware set `UCX_TLS` themselves (e.g. `rc,cuda_copy`).
`UCX_USE_MT_MUTEX` defaults to `y` (a mutex, not a spinlock, around the UCX worker).
"""

from __future__ import annotations

import importlib
import logging
import os
import sys
import threading
import time
from types import ModuleType
from typing import Any

import numpy as np
import torch

from services.kv_transfer.connector import (
    BlockRun,
    KVConnector,
    KVTransferError,
    RemotePeer,
    b64decode,
    b64encode,
)
from services.kv_transfer.handshake import KVCompatibilityError, PeerInfo

logger = logging.getLogger(__name__)

DEFAULT_UCX_TLS = "tcp"
_MEM_TYPES = ("DRAM", "VRAM")


class NixlUnavailableError(RuntimeError):
    """NIXL is not installed here, or its agent could not start."""


# The Python API creates its agents with a progress-thread poll timeout of 0 µs, so the thread
# busy-polls a whole core even when idle. The thread waits on the UCX workers' event fds, so a
# longer timeout costs no transfer latency: incoming traffic wakes it at once.
PROGRESS_THREAD_POLL_US = 5000
_config_lock = threading.Lock()


def make_agent(nixl: ModuleType, name: str, config: Any) -> Any:
    """``nixl.nixl_agent(name, config)`` with a progress thread that sleeps when idle.

    The agent config the API builds is replaced, for this one construction, by a subclass whose
    ``pthrDelay`` is never below ``PROGRESS_THREAD_POLL_US``.
    """
    bindings: Any = getattr(nixl, "_bindings", None) or getattr(
        sys.modules.get(f"{nixl.__name__}._api"), "nixlBind", None
    )
    base = getattr(bindings, "nixlAgentConfig", None)
    if bindings is None or base is None or not isinstance(getattr(base, "pthrDelay", None), property):
        return nixl.nixl_agent(name, config)  # another layout: take the API as it is

    def get_delay(self: Any) -> int:
        return base.pthrDelay.__get__(self)

    def set_delay(self: Any, value: int) -> None:
        base.pthrDelay.__set__(self, max(int(value), PROGRESS_THREAD_POLL_US))

    sleepy = type("SleepyAgentConfig", (base,), {"pthrDelay": property(get_delay, set_delay)})
    with _config_lock:
        bindings.nixlAgentConfig = sleepy
        try:
            return nixl.nixl_agent(name, config)
        finally:
            bindings.nixlAgentConfig = base


def import_nixl() -> ModuleType:
    """The NIXL Python module: the wheel matching torch's CUDA major version first, then the others."""
    cuda_version = torch.version.cuda or ""
    if cuda_version.startswith("13"):
        names = ["nixl_cu13", "nixl_cu12", "nixl"]
    else:
        names = ["nixl_cu12", "nixl_cu13", "nixl"]
    errors = []
    for name in names:
        try:
            return importlib.import_module(name)
        except ImportError as exc:
            errors.append(f"{name}: {exc}")
    raise NixlUnavailableError("no NIXL module imports (" + "; ".join(errors) + ")")


class NixlConnector(KVConnector):
    """KV connector over a NIXL agent (UCX backend)."""

    backend_name = "nixl"

    def __init__(self, kv_cache: torch.Tensor, peer_info: PeerInfo, **options: Any) -> None:
        super().__init__(kv_cache, peer_info, **options)  # timeout_s, local_reads (KVConnector)
        nixl = import_nixl()
        self.module_name = nixl.__name__
        if not os.environ.get("UCX_TLS"):  # an empty value makes UCX refuse to start
            os.environ["UCX_TLS"] = DEFAULT_UCX_TLS
        # UCX guards a multi-threaded worker with a spinlock by default; the agent's progress thread and
        # the caller then spin against each other, worst when both share one core (a decode worker under
        # `cleave serve`'s CPU split: 6% of its CPU in pthread_spin_lock, measured). A mutex sleeps.
        os.environ.setdefault("UCX_USE_MT_MUTEX", "y")
        self.ucx_tls = os.environ["UCX_TLS"]
        self.mem_type = "VRAM" if kv_cache.is_cuda else "DRAM"
        self.device_id = (kv_cache.device.index or 0) if kv_cache.is_cuda else 0
        self.base_addr = kv_cache.data_ptr()
        # The agent is created without NIXL's internal locking; every call on it goes through this lock.
        self._agent_lock = threading.Lock()
        self._add_lock = threading.Lock()
        self._agent: Any = None
        try:
            self._agent = make_agent(nixl, self.name, nixl.nixl_agent_config(backends=["UCX"]))
            if "UCX" not in self._agent.backends:
                raise NixlUnavailableError(f"{nixl.__name__} has no UCX plugin")
            self._registration = self._agent.register_memory(kv_cache)
            self._agent_metadata = self._agent.get_agent_metadata()
        except NixlUnavailableError:
            raise
        except Exception as exc:
            raise NixlUnavailableError(f"NIXL agent could not start ({type(exc).__name__}: {exc})") from exc
        logger.info(
            "nixl_agent_ready name=%s module=%s mem_type=%s ucx_tls=%s bytes=%d",
            self.name,
            self.module_name,
            self.mem_type,
            self.ucx_tls,
            self.num_blocks * self.block_bytes,
        )

    def _backend_metadata(self) -> dict[str, Any]:
        return {
            "agent_metadata": b64encode(self._agent_metadata),
            "base_addr": self.base_addr,
            "mem_type": self.mem_type,
            "device_id": self.device_id,
        }

    def add_peer(self, metadata: bytes) -> str:
        # Serialised so two threads adding the same peer load its agent metadata once.
        with self._add_lock:
            return super().add_peer(metadata)

    def _connect_peer(self, peer: RemotePeer) -> None:
        payload = peer.payload
        if payload.get("mem_type") not in _MEM_TYPES or not isinstance(payload.get("base_addr"), int):
            raise KVCompatibilityError(f"NIXL metadata of peer {peer.peer_id} lacks mem_type/base_addr")
        try:
            with self._agent_lock:
                agent_name = self._open_agent().add_remote_agent(b64decode(payload["agent_metadata"]))
        except KVTransferError:
            raise
        except Exception as exc:
            raise KVTransferError(f"could not load NIXL metadata of peer {peer.peer_id}: {exc!r}") from exc
        name = agent_name.decode() if isinstance(agent_name, bytes) else str(agent_name)
        if name != peer.peer_id:
            raise KVTransferError(f"NIXL agent metadata names {name!r}, envelope names {peer.peer_id!r}")
        try:
            with self._agent_lock:
                self._open_agent().make_connection(peer.peer_id)
        except Exception as exc:  # the first transfer connects anyway
            logger.warning("nixl_connect_failed peer=%s error=%r", peer.peer_id, exc)

    def _disconnect_peer(self, peer: RemotePeer) -> None:
        try:
            with self._agent_lock:
                self._open_agent().remove_remote_agent(peer.peer_id)
        except Exception as exc:
            logger.debug("nixl_remove_peer_failed peer=%s error=%r", peer.peer_id, exc)

    def _descriptors(self, runs: list[BlockRun], peer: RemotePeer) -> tuple[np.ndarray, np.ndarray]:
        """Local and remote descriptor arrays, one (addr, len, device_id) row per run."""
        block_bytes = self.block_bytes
        local = np.array(
            [(self.base_addr + r.local_start * block_bytes, r.num_blocks * block_bytes, self.device_id) for r in runs],
            dtype=np.uint64,
        )  # [num_runs, 3]
        remote_base = peer.payload["base_addr"]
        remote_device = int(peer.payload.get("device_id", 0))
        remote = np.array(
            [(remote_base + r.remote_start * block_bytes, r.num_blocks * block_bytes, remote_device) for r in runs],
            dtype=np.uint64,
        )  # [num_runs, 3]
        return local, remote

    def _read_runs(self, peer: RemotePeer, runs: list[BlockRun]) -> None:
        local, remote = self._descriptors(runs, peer)
        deadline = time.monotonic() + self.timeout_s
        try:
            with self._agent_lock:
                agent = self._open_agent()
                local_descs = agent.get_xfer_descs(local, self.mem_type)
                remote_descs = agent.get_xfer_descs(remote, peer.payload["mem_type"])
                handle = agent.initialize_xfer("READ", local_descs, remote_descs, peer.peer_id)
        except KVTransferError:
            raise
        except Exception as exc:
            raise KVTransferError(f"NIXL READ from peer {peer.peer_id} could not be created: {exc!r}") from exc
        try:
            self._post_and_wait(handle, peer.peer_id, deadline)
        finally:
            self._release(handle, peer.peer_id)

    def _post_and_wait(self, handle: Any, peer_id: str, deadline: float) -> None:
        try:
            with self._agent_lock:
                state = self._open_agent().transfer(handle)
            delay_s = 20e-6
            while state == "PROC":
                if time.monotonic() > deadline:
                    raise KVTransferError(f"NIXL READ from peer {peer_id} did not finish within {self.timeout_s:g} s")
                time.sleep(delay_s)
                delay_s = min(delay_s * 2, 1e-3)
                with self._agent_lock:
                    state = self._open_agent().check_xfer_state(handle)
        except KVTransferError:
            raise
        except Exception as exc:  # nixlRemoteDisconnectError and friends
            raise KVTransferError(f"NIXL READ from peer {peer_id} failed: {exc!r}") from exc
        if state != "DONE":
            raise KVTransferError(f"NIXL READ from peer {peer_id} ended in state {state}")

    def _open_agent(self) -> Any:
        """The agent; call with `_agent_lock` held."""
        if self._agent is None:
            raise KVTransferError("NIXL connector is closed")
        return self._agent

    def _release(self, handle: Any, peer_id: str) -> None:
        try:
            with self._agent_lock:  # the handle keeps its own reference to the native agent
                handle.release()
        except Exception as exc:
            # NIXL keeps a handle it could not cancel and frees it with the agent.
            logger.error("nixl_release_failed peer=%s error=%r", peer_id, exc)

    def _close_backend(self) -> None:
        with self._agent_lock:
            agent, self._agent = self._agent, None
            if agent is None:
                return
            with self._lock:
                peer_ids = list(self._peers)
            for peer_id in peer_ids:
                try:
                    agent.remove_remote_agent(peer_id)
                except Exception as exc:
                    logger.debug("nixl_remove_peer_failed peer=%s error=%r", peer_id, exc)
            try:
                agent.deregister_memory(self._registration)
            except Exception as exc:
                logger.warning("nixl_deregister_failed error=%r", exc)
        # Dropping the last reference destroys the agent (unless a transfer handle still holds it).
