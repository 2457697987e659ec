"""KV blocks read straight from a peer process's memory, when the peer runs on this machine.

A prefill and a decode worker on one box (``cleave serve``) hold their KV caches in
ordinary process memory. Instead of sending the blocks through the transfer
backend (NIXL over UCX, or TCP: a copy into a socket, another out of it, and
milliseconds of latency per pull), the decode worker copies them with
``process_vm_readv(2)``: one system call per pull, memory to memory, at memcpy
speed (a 1.5 MB prompt: ~0.2 ms here against ~3 ms over NIXL/UCX tcp).

The peer describes its cache in its connector metadata (``describe``): the
machine's boot id, its PID namespace, its PID and start time, the cache's
address and size. ``open_region`` accepts that description only when all of
them match a live process here and a probe read succeeds (the kernel allows it
to a process of the same user where ptrace is permitted); otherwise the
connector keeps its backend. The start time is checked again after every read,
so a PID that a new process has taken over can never pass for the peer.

Metadata arrives over the network, so a description alone proves nothing: a
forged one could name any process of the same user and any address in it. The
describing process therefore also writes its description to a file of its own
(the ``proof``: in its temporary directory, owned by its user, removed when the
description is withdrawn or at exit); ``open_region`` reads that file through
``/proc/PID/root`` and accepts the description only if the file is a regular
file of this user that says exactly the same. Only the process itself (or one
that could read its memory anyway) can have written it, so a description is
honoured only for memory its process offered.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import errno
import json
import os
import re
import stat
import sys
import tempfile
from dataclasses import dataclass
from typing import Any

import torch

_IOV_MAX = 1024  # iovecs per call (Linux UIO_MAXIOV)
_PROOF_PREFIX = "cleave-kv-"
_PROOF_NAME = re.compile(re.escape(_PROOF_PREFIX) + r"(\d+)-(\d+)-[0-9a-f]+\.json")
_PROOF_MAX_BYTES = 4096


class _Iovec(ctypes.Structure):
    _fields_ = [("iov_base", ctypes.c_void_p), ("iov_len", ctypes.c_size_t)]


_readv: Any = None


def _process_vm_readv() -> Any:
    """libc's process_vm_readv (released GIL, errno kept), or None where there is none."""
    global _readv
    if _readv is None:
        _readv = False
        if sys.platform.startswith("linux"):
            try:
                fn = ctypes.CDLL(None, use_errno=True).process_vm_readv
            except (OSError, AttributeError):
                return None
            fn.restype = ctypes.c_ssize_t
            fn.argtypes = [ctypes.c_int, ctypes.POINTER(_Iovec), ctypes.c_ulong, ctypes.POINTER(_Iovec),
                           ctypes.c_ulong, ctypes.c_ulong]  # fmt: skip
            _readv = fn
    return _readv or None


def _read_text(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return None


def _pid_namespace() -> str | None:
    try:
        st = os.stat("/proc/self/ns/pid")
    except OSError:
        return None
    return f"{st.st_dev}:{st.st_ino}"


def start_time(pid: int) -> int | None:
    """The process's start time in clock ticks since boot (``/proc/PID/stat`` field 22); None if it is gone."""
    text = _read_text(f"/proc/{pid}/stat")
    if text is None:
        return None
    fields = text.rsplit(")", 1)[-1].split()  # the name in parentheses may hold spaces
    try:
        return int(fields[19])  # fields[0] is field 3 (the state)
    except (IndexError, ValueError):
        return None


def describe(kv_cache: torch.Tensor) -> dict[str, Any] | None:
    """What a peer on this machine needs to read ``kv_cache``; None where it cannot (not in host memory,
    not contiguous, no process_vm_readv, no writable temporary directory).

    Writes the description's proof file; ``withdraw`` removes it (and exit does, for those still offered)."""
    if kv_cache.device.type != "cpu" or not kv_cache.is_contiguous() or _process_vm_readv() is None:
        return None
    pid = os.getpid()
    boot_id, namespace, started = _read_text("/proc/sys/kernel/random/boot_id"), _pid_namespace(), start_time(pid)
    if boot_id is None or namespace is None or started is None:
        return None
    address = kv_cache.data_ptr()
    description = {"boot_id": boot_id, "pid_namespace": namespace, "pid": pid, "start_time": started,
                   "address": address, "num_bytes": kv_cache.numel() * kv_cache.element_size()}  # fmt: skip
    directory = os.path.realpath(tempfile.gettempdir())
    _remove_stale_proofs(directory)
    proof = os.path.join(directory, f"{_PROOF_PREFIX}{pid}-{started}-{address:x}.json")
    try:
        _write_proof(proof, description)
    except OSError:
        return None
    description["proof"] = proof
    _offered.add(proof)
    return description


def withdraw(description: dict[str, Any] | None) -> None:
    """Stop offering a cache ``describe`` described: its proof file goes, so no new peer opens it."""
    if description is not None:
        _offered.discard(description["proof"])
        _unlink(description["proof"])


_offered: set[str] = set()  # proof files this process has written and not withdrawn


@atexit.register
def _withdraw_all() -> None:
    for proof in list(_offered):
        _unlink(proof)


def _write_proof(path: str, description: dict[str, Any]) -> None:
    staging = f"{path}.{os.urandom(4).hex()}"
    fd = os.open(staging, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(description, f, sort_keys=True)
        os.replace(staging, path)
    except OSError:
        _unlink(staging)
        raise


def _unlink(path: str) -> None:
    with contextlib.suppress(OSError):
        os.unlink(path)


def _remove_stale_proofs(directory: str) -> None:
    """Proof files of this user's processes that are gone (killed before they could remove theirs)."""
    try:
        names = os.listdir(directory)
    except OSError:
        return
    uid = os.geteuid()
    for name in names:
        match = _PROOF_NAME.fullmatch(name)
        if match is None or start_time(int(match[1])) == int(match[2]):
            continue
        path = os.path.join(directory, name)
        with contextlib.suppress(OSError):
            if os.lstat(path).st_uid == uid:
                os.unlink(path)


def _proven(region: Region, description: dict[str, Any]) -> str:
    """Why the peer's proof file does not vouch for ``description``; "" if it does."""
    proof = description.get("proof")
    if not isinstance(proof, str) or not proof.startswith("/") or os.path.normpath(proof) != proof:
        return "no proof file in the host memory description"
    named = _PROOF_NAME.fullmatch(os.path.basename(proof))
    if named is None or (int(named[1]), int(named[2])) != (region.pid, region.start_time):
        return f"the proof file {proof} is not one of process {region.pid}"
    try:
        # O_NONBLOCK: a FIFO named as the proof must not hang the reader; it is refused below.
        fd = os.open(f"/proc/{region.pid}/root{proof}", os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as exc:
        return f"process {region.pid} has no proof file {proof}: {exc.strerror}"
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid() or st.st_size > _PROOF_MAX_BYTES:
            return f"proof file {proof} of process {region.pid} is not a small regular file of this user"
        text = f.read(_PROOF_MAX_BYTES)
    try:
        written = json.loads(text)
    except ValueError:
        return f"proof file {proof} of process {region.pid} is not a description"
    if written != {k: v for k, v in description.items() if k != "proof"}:
        return f"process {region.pid} did not offer this memory (its proof file says otherwise)"
    return ""


@dataclass(frozen=True)
class Region:
    """A peer's KV cache in another process on this machine."""

    pid: int
    start_time: int
    address: int
    num_bytes: int


class ReadFailed(RuntimeError):
    pass


def open_region(payload: Any) -> tuple[Region | None, str]:
    """The peer's cache as a readable region, or (None, why not)."""
    if not isinstance(payload, dict):
        return None, "no host memory description"
    if _process_vm_readv() is None:
        return None, "no process_vm_readv here"
    try:
        region = Region(int(payload["pid"]), int(payload["start_time"]), int(payload["address"]),
                        int(payload["num_bytes"]))  # fmt: skip
        boot_id, namespace = str(payload["boot_id"]), str(payload["pid_namespace"])
    except (KeyError, TypeError, ValueError):
        return None, "malformed host memory description"
    if boot_id != _read_text("/proc/sys/kernel/random/boot_id"):
        return None, "another machine"
    if namespace != _pid_namespace():
        return None, "another PID namespace"
    if start_time(region.pid) != region.start_time:
        return None, f"process {region.pid} is not the peer"
    why_not = _proven(region, payload)
    if why_not:
        return None, why_not
    probe = ctypes.create_string_buffer(64)
    try:
        read(region, [(ctypes.addressof(probe), region.address, min(64, region.num_bytes))])
    except ReadFailed as exc:
        return None, str(exc)
    return region, ""


def read(region: Region, copies: list[tuple[int, int, int]]) -> None:
    """Copy each (local address, remote address, bytes) from the peer; raises ReadFailed."""
    readv = _process_vm_readv()
    if readv is None:
        raise ReadFailed("no process_vm_readv here")
    for _, src, size in copies:
        if src < region.address or src + size > region.address + region.num_bytes:
            raise ReadFailed(f"bytes [{src}, {src + size}) outside the peer's cache")
    for first in range(0, len(copies), _IOV_MAX):
        batch = copies[first : first + _IOV_MAX]
        local = (_Iovec * len(batch))(*[_Iovec(dst, size) for dst, _, size in batch])
        remote = (_Iovec * len(batch))(*[_Iovec(src, size) for _, src, size in batch])
        expected = sum(size for _, _, size in batch)
        done = readv(region.pid, local, len(batch), remote, len(batch), 0)
        if done != expected:
            code = ctypes.get_errno() if done < 0 else errno.EIO
            raise ReadFailed(f"reading process {region.pid}: {os.strerror(code)} ({max(done, 0)} of {expected} bytes)")
    if start_time(region.pid) != region.start_time:
        raise ReadFailed(f"process {region.pid} exited")
