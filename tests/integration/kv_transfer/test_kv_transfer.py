"""KV block pulls between real processes, over NIXL (when it imports) and plain TCP.

A helper process (`peer_proc.py`) plays the prefill worker: it fills its
kv_caches with known values and publishes connector metadata on stdout. The
test process plays the decode worker and pulls blocks into its own caches.
"""

from __future__ import annotations

import base64
import importlib.util
import json
import os
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from services.kv_transfer.connector import (
    BlockRun,
    KVConnector,
    KVTransferError,
    create_connector,
    make_peer_info,
    merge_block_runs,
)
from services.kv_transfer.handshake import KVCompatibilityError
from services.kv_transfer.nixl_backend import NixlUnavailableError, import_nixl

HERE = Path(__file__).resolve().parent
REPO_ROOT = HERE.parents[2]
_spec = importlib.util.spec_from_file_location("kv_peer_proc", HERE / "peer_proc.py")
assert _spec is not None and _spec.loader is not None
peer_proc = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(peer_proc)

try:
    import_nixl()
    HAS_NIXL = True
except NixlUnavailableError:
    HAS_NIXL = False

BACKENDS = ["tcp", pytest.param("nixl", marks=pytest.mark.skipif(not HAS_NIXL, reason="NIXL does not import"))]
DTYPES = ["float32", "bfloat16"]
BLOCK_SIZE = 4
SEED = {"float32": 11, "bfloat16": 22}


class PeerProcess:
    """A running peer_proc.py; `metadata[i]` belongs to `specs[i]`."""

    def __init__(self, specs: list[dict]) -> None:
        env = {**os.environ, "NIXL_LOG_LEVEL": "WARN", "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO_ROOT)}
        self.proc = subprocess.Popen(
            [sys.executable, str(HERE / "peer_proc.py"), json.dumps(specs)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            cwd=REPO_ROOT,
            env=env,
        )
        self._metadata: list[bytes] | None = None

    @property
    def metadata(self) -> list[bytes]:
        """Waits for the process to publish its metadata (start several processes before asking)."""
        if self._metadata is None:
            self._metadata = self._read_metadata()
        return self._metadata

    def _read_metadata(self) -> list[bytes]:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:  # NIXL may log to stdout first
            if line.startswith(peer_proc.METADATA_PREFIX):
                encoded = json.loads(base64.b64decode(line[len(peer_proc.METADATA_PREFIX) :]))
                return [base64.b64decode(item) for item in encoded]
        raise RuntimeError(f"peer process exited with {self.proc.wait()} before publishing metadata")

    def signal(self, signum: int) -> None:
        self.proc.send_signal(signum)
        if signum == signal.SIGKILL:
            self.proc.wait(timeout=10)
        elif signum == signal.SIGSTOP:  # delivery is asynchronous: wait until the process is stopped
            stat = Path(f"/proc/{self.proc.pid}/stat")
            deadline = time.monotonic() + 5
            while stat.read_text().rsplit(")", 1)[1].split()[0] != "T" and time.monotonic() < deadline:
                time.sleep(0.01)

    def stop(self) -> None:
        if self.proc.poll() is None:
            assert self.proc.stdin is not None
            self.proc.stdin.close()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def spec(backend: str, dtype: str, block_size: int = BLOCK_SIZE) -> dict:
    return {"backend": backend, "dtype": dtype, "block_size": block_size, "seed": SEED[dtype]}


def available_backends() -> list[str]:
    return ["tcp", "nixl"] if HAS_NIXL else ["tcp"]


PREFILL_KEYS = [(backend, dtype) for backend in available_backends() for dtype in DTYPES]


@pytest.fixture(scope="module")
def peer_processes():
    """Both helper processes, started together so their start-up overlaps: (prefill, victim)."""
    prefill = PeerProcess([spec(backend, dtype) for backend, dtype in PREFILL_KEYS])
    victim = PeerProcess([spec(backend, "float32") for backend in available_backends()])
    yield prefill, victim
    for peer in (prefill, victim):
        if peer.proc.poll() is None:
            peer.signal(signal.SIGCONT)
        peer.stop()


@pytest.fixture(scope="module")
def prefill_peer(peer_processes):
    """One prefill process serving every (backend, dtype) pair: {(backend, dtype): metadata}."""
    return dict(zip(PREFILL_KEYS, peer_processes[0].metadata, strict=True))


def decode_connector(
    backend: str, dtype: str, block_size: int = BLOCK_SIZE, timeout_s: float = 5.0, local_reads: bool = False
) -> KVConnector:
    """The reading side. The peer process runs on this machine, so without ``local_reads=False`` every pull would
    read its memory directly and never touch the backend under test."""
    kv_cache = torch.zeros(peer_proc.kv_shape(block_size), dtype=getattr(torch, dtype))
    peer_info = make_peer_info(kv_cache, model_id=peer_proc.MODEL_ID, role="decode")
    return create_connector(kv_cache, peer_info, backend=backend, timeout_s=timeout_s, local_reads=local_reads)


def expected_cache(dtype: str) -> torch.Tensor:
    return peer_proc.fill_kv_cache(BLOCK_SIZE, getattr(torch, dtype), SEED[dtype])


def same_bytes(actual: torch.Tensor, expected: torch.Tensor) -> bool:
    return torch.equal(actual.contiguous().view(torch.uint8), expected.contiguous().view(torch.uint8))


# --- descriptor merging -------------------------------------------------------------


def test_merge_block_runs():
    assert merge_block_runs([3, 4, 5, 9], [10, 11, 12, 0]) == [BlockRun(3, 10, 3), BlockRun(9, 0, 1)]
    assert merge_block_runs([], []) == []
    assert merge_block_runs([7], [2]) == [BlockRun(7, 2, 1)]
    # Contiguous remote but not local (and the reverse) must not merge.
    assert merge_block_runs([1, 2, 3], [5, 7, 8]) == [BlockRun(1, 5, 1), BlockRun(2, 7, 2)]
    assert merge_block_runs([1, 3, 4], [5, 6, 7]) == [BlockRun(1, 5, 1), BlockRun(3, 6, 2)]
    # Descending ids are separate runs.
    assert merge_block_runs([4, 3], [1, 0]) == [BlockRun(4, 1, 1), BlockRun(3, 0, 1)]
    with pytest.raises(ValueError, match="2 remote block ids but 1 local"):
        merge_block_runs([1, 2], [3])


# --- pulls ----------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("backend", BACKENDS)
def test_pull_copies_exact_bytes(prefill_peer, backend, dtype):
    expected = expected_cache(dtype)
    with decode_connector(backend, dtype) as connector:
        assert connector.backend_name == backend
        peer_id = connector.add_peer(prefill_peer[(backend, dtype)])
        assert connector.add_peer(prefill_peer[(backend, dtype)]) == peer_id  # idempotent

        stats = connector.pull(peer_id, [3, 4, 5, 9], [10, 11, 12, 0])

        local = connector.kv_cache
        block_bytes = local[0].numel() * local.element_size()
        assert stats.num_bytes == 4 * block_bytes
        assert stats.num_descriptors == 2
        assert stats.seconds > 0
        assert same_bytes(local[10:13], expected[3:6])
        assert same_bytes(local[0], expected[9])
        untouched = [i for i in range(local.shape[0]) if i not in (0, 10, 11, 12)]
        assert not local[untouched].any()

        # A second pull over the cached connection; a single descriptor this time.
        stats = connector.pull(peer_id, [20, 21, 22, 23, 24], [1, 2, 3, 4, 5])
        assert stats.num_descriptors == 1 and stats.num_bytes == 5 * block_bytes
        assert same_bytes(local[1:6], expected[20:25])
        assert connector.transfers_total == 2
        assert connector.bytes_total == 9 * block_bytes
        assert connector.failures_total == 0 and connector.seconds_total > 0
        assert connector.pull(peer_id, [], []).num_bytes == 0

        # A removed peer is unknown until added again.
        assert connector.remove_peer(peer_id) and not connector.remove_peer(peer_id)
        with pytest.raises(KVTransferError, match="add_peer"):
            connector.pull(peer_id, [7], [7])
        assert connector.add_peer(prefill_peer[(backend, dtype)]) == peer_id
        connector.pull(peer_id, [7], [7])
        assert same_bytes(local[7], expected[7])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("backend", BACKENDS)
def test_a_peer_on_this_machine_is_read_from_its_memory(prefill_peer, backend, dtype, monkeypatch):
    """With local reads (the default) the blocks come straight from the peer process's memory: the backend is
    never asked (it would fail here), and the bytes are the peer's."""
    expected = expected_cache(dtype)
    with decode_connector(backend, dtype, local_reads=True) as connector:

        def no_backend(peer, runs):
            raise AssertionError("the backend was used for a peer on this machine")

        monkeypatch.setattr(connector, "_read_runs", no_backend)
        peer_id = connector.add_peer(prefill_peer[(backend, dtype)])
        assert connector.reads_locally(peer_id)
        stats = connector.pull(peer_id, [3, 4, 5, 9, 31], [10, 11, 12, 0, 31])
        assert stats.num_descriptors == 3 and stats.num_bytes == 5 * connector.block_bytes
        local = connector.kv_cache
        assert same_bytes(local[10:13], expected[3:6])
        assert same_bytes(local[0], expected[9]) and same_bytes(local[31], expected[31])
        assert not local[[i for i in range(local.shape[0]) if i not in (0, 10, 11, 12, 31)]].any()
        with pytest.raises(KVTransferError, match="out of range"):
            connector.pull(peer_id, [32], [1])  # past the peer's cache: refused before any read
        assert connector.transfers_total == 1


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_peer_elsewhere_is_read_through_the_backend(prefill_peer, backend):
    """A peer whose description names another machine, or memory its process did not offer (a forged
    address or size: its proof file says otherwise), or that sends none, goes through the backend."""
    envelope = json.loads(prefill_peer[(backend, "float32")])
    described = envelope["host_memory"]
    assert described["pid"] != os.getpid()
    expected = expected_cache("float32")
    forged = [
        {**described, "boot_id": "another-machine"},
        {**described, "address": described["address"] - 4096},
        {**described, "num_bytes": described["num_bytes"] * 2},
        {k: v for k, v in described.items() if k != "proof"},
        None,
    ]
    for host in forged:
        changed = (
            {**envelope, "host_memory": host}
            if host is not None
            else {k: v for k, v in envelope.items() if k != "host_memory"}
        )
        with decode_connector(backend, "float32", local_reads=True) as connector:
            peer_id = connector.add_peer(json.dumps(changed).encode())
            assert not connector.reads_locally(peer_id)
            connector.pull(peer_id, [6, 7], [1, 2])
            assert same_bytes(connector.kv_cache[1:3], expected[6:8])
    with decode_connector(backend, "float32", local_reads=False) as connector:
        assert not connector.reads_locally(connector.add_peer(prefill_peer[(backend, "float32")]))
        assert b"host_memory" not in connector.local_metadata()


def test_local_reads_of_a_dead_peer_fail_at_once():
    """A peer killed after the handshake: the next pull fails (the caller then recomputes), it does not hang
    nor read whatever process comes next under that PID."""
    peer = PeerProcess([spec("tcp", "float32")])
    try:
        with decode_connector("tcp", "float32", local_reads=True) as connector:
            peer_id = connector.add_peer(peer.metadata[0])
            assert connector.reads_locally(peer_id)
            connector.pull(peer_id, [1], [1])
            peer.signal(signal.SIGKILL)
            peer.proc.wait(timeout=10)
            start = time.monotonic()
            with pytest.raises(KVTransferError, match="reading the KV blocks"):
                connector.pull(peer_id, [2, 3], [2, 3])
            assert time.monotonic() - start < 1.0
            assert connector.failures_total == 1
    finally:
        peer.stop()


@pytest.mark.parametrize("backend", BACKENDS)
def test_concurrent_pulls(prefill_peer, backend):
    expected = expected_cache("float32")
    with decode_connector(backend, "float32") as connector:
        peer_id = connector.add_peer(prefill_peer[(backend, "float32")])
        errors: list[BaseException] = []

        def pull(offset: int) -> None:
            try:
                for _ in range(5):
                    connector.pull(peer_id, [offset, offset + 1], [31 - offset, 30 - offset])
            except BaseException as exc:  # reported below
                errors.append(exc)

        threads = [threading.Thread(target=pull, args=(offset,)) for offset in (0, 4, 8, 12)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=20)
        assert not errors
        for offset in (0, 4, 8, 12):
            assert same_bytes(connector.kv_cache[31 - offset], expected[offset])
            assert same_bytes(connector.kv_cache[30 - offset], expected[offset + 1])
        assert connector.transfers_total == 20


@pytest.mark.parametrize("backend", BACKENDS)
def test_bad_block_ids_and_unknown_peer(prefill_peer, backend):
    with decode_connector(backend, "float32") as connector:
        peer_id = connector.add_peer(prefill_peer[(backend, "float32")])
        with pytest.raises(KVTransferError, match="out of range"):
            connector.pull(peer_id, [31, 32], [0, 1])
        with pytest.raises(ValueError, match="local block ids"):
            connector.pull(peer_id, [0], [32])
        with pytest.raises(KVTransferError, match="add_peer"):
            connector.pull("nobody", [0], [0])
        assert connector.failures_total == 2
        connector.close()
        with pytest.raises(KVTransferError, match="closed"):
            connector.pull(peer_id, [0], [0])
        connector.close()  # twice is fine


def test_auto_backend_prefers_nixl():
    with decode_connector("auto", "float32") as connector:
        assert connector.backend_name == ("nixl" if HAS_NIXL else "tcp")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_pull_between_cuda_caches():
    backends = available_backends()
    peer = PeerProcess([{**spec(backend, "bfloat16"), "device": "cuda"} for backend in backends])
    try:
        expected = expected_cache("bfloat16").cuda()
        for backend, metadata in zip(backends, peer.metadata, strict=True):
            kv_cache = torch.zeros(peer_proc.kv_shape(BLOCK_SIZE), dtype=torch.bfloat16, device="cuda")
            peer_info = make_peer_info(kv_cache, model_id=peer_proc.MODEL_ID, role="decode")
            with create_connector(kv_cache, peer_info, backend=backend) as connector:
                stats = connector.pull(connector.add_peer(metadata), [3, 4, 5, 9], [10, 11, 12, 0])
                torch.cuda.synchronize()
                assert stats.num_descriptors == 2
                assert same_bytes(kv_cache[10:13], expected[3:6]) and same_bytes(kv_cache[0], expected[9]), backend
    finally:
        peer.stop()


def test_auto_falls_back_to_tcp_without_nixl(monkeypatch):
    from services.kv_transfer import nixl_backend

    def unavailable():
        raise NixlUnavailableError("no NIXL module imports (test)")

    monkeypatch.setattr(nixl_backend, "import_nixl", unavailable)
    with decode_connector("auto", "float32") as connector:
        assert connector.backend_name == "tcp"
    with pytest.raises(RuntimeError, match="install nixl-cu12.*--kv-transfer-backend tcp"):
        decode_connector("nixl", "float32")


def test_peer_info_must_describe_the_cache():
    kv_cache = torch.zeros(peer_proc.kv_shape(BLOCK_SIZE))
    wrong = make_peer_info(torch.zeros(peer_proc.kv_shape(8)), model_id=peer_proc.MODEL_ID)
    with pytest.raises(ValueError, match="does not describe kv_cache"):
        create_connector(kv_cache, wrong, backend="tcp")
    with pytest.raises(ValueError, match="unknown KV transfer backend"):
        create_connector(kv_cache, make_peer_info(kv_cache, model_id="m"), backend="rdma")


# --- compatibility --------------------------------------------------------------------


def _tampered(metadata: bytes, **peer_fields) -> bytes:
    envelope = json.loads(metadata)
    envelope["peer_info"].update(peer_fields)
    return json.dumps(envelope).encode()


@pytest.mark.parametrize("backend", BACKENDS)
def test_incompatible_peer_is_refused(prefill_peer, backend):
    metadata = prefill_peer[(backend, "float32")]
    with decode_connector(backend, "float32", block_size=8) as connector:
        with pytest.raises(KVCompatibilityError) as info:
            connector.add_peer(metadata)
    message = str(info.value)
    assert "prefill worker uses block_size 4, this decode worker 8" in message
    assert "--block-size" in message

    with decode_connector(backend, "bfloat16") as connector:
        with pytest.raises(KVCompatibilityError, match="dtype 'float32', this decode worker 'bfloat16'.*--dtype"):
            connector.add_peer(metadata)

    with decode_connector(backend, "float32") as connector:
        with pytest.raises(KVCompatibilityError, match="protocol 99, this decode worker 1"):
            connector.add_peer(_tampered(metadata, protocol_version=99))
        with pytest.raises(KVCompatibilityError, match="compatibility hash 0000.*same Cleave version"):
            connector.add_peer(_tampered(metadata, compat_hash="0000000000000000"))
        other = "tcp" if backend == "nixl" else "nixl"
        with pytest.raises(KVCompatibilityError, match="--kv-transfer-backend"):
            connector.add_peer(_tampered(metadata, backend=other))
        with pytest.raises(KVCompatibilityError, match="not valid JSON"):
            connector.add_peer(b"\x00garbage")


# --- faults ---------------------------------------------------------------------------


def _misbehaving_server(reply: bytes) -> tuple[socket.socket, threading.Thread]:
    """A one-shot server that reads a request, sends `reply` and hangs up."""
    server = socket.create_server(("127.0.0.1", 0))

    def serve() -> None:
        conn, _ = server.accept()
        with conn:
            conn.recv(1 << 16)
            conn.sendall(reply)

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    return server, thread


@pytest.mark.parametrize(
    "reply, error",
    [
        (struct.pack("!4sHHQ", b"CKVR", 1, 0, 2048) + b"x" * 1000, "closed after 1000 of 2048 bytes"),
        (struct.pack("!4sHHQ", b"HTTP", 1, 0, 2048), "magic"),
        (struct.pack("!4sHHQ", b"CKVR", 1, 0, 999), "announced 999 bytes, expected 2048"),
        (struct.pack("!4sHHQ", b"CKVR", 1, 1, 4) + b"nope", "peer refused the pull: nope"),
    ],
)
def test_tcp_short_or_bad_replies_fail_cleanly(reply, error):
    server, thread = _misbehaving_server(reply)
    with decode_connector("tcp", "float32") as prefill, decode_connector("tcp", "float32") as decode:
        envelope = json.loads(prefill.local_metadata())
        envelope["backend"]["port"] = server.getsockname()[1]
        peer_id = decode.add_peer(json.dumps(envelope).encode())
        with pytest.raises(KVTransferError, match=error):
            decode.pull(peer_id, [0, 1], [0, 1])
    thread.join(timeout=5)
    server.close()


def test_stopped_or_killed_peer_fails_within_timeout(peer_processes):
    """A frozen peer (SIGSTOP) times out, then recovers (SIGCONT); a dead one (SIGKILL) fails fast."""
    backends = available_backends()
    peer = peer_processes[1]
    connectors = [decode_connector(backend, "float32", timeout_s=1.0) for backend in backends]
    try:
        peer_ids = [c.add_peer(m) for c, m in zip(connectors, peer.metadata, strict=True)]
        for connector, peer_id in zip(connectors, peer_ids, strict=True):
            connector.pull(peer_id, [1, 2], [3, 4])  # connected and working

        peer.signal(signal.SIGSTOP)
        for connector, peer_id in zip(connectors, peer_ids, strict=True):
            start = time.monotonic()
            with pytest.raises(KVTransferError, match="within 1 s"):
                connector.pull(peer_id, list(range(16)), list(range(16)))
            assert time.monotonic() - start < 3.0, connector.backend_name

        peer.signal(signal.SIGCONT)  # the peer recovers: the next pull works again
        expected = expected_cache("float32")
        for connector, peer_id in zip(connectors, peer_ids, strict=True):
            connector.pull(peer_id, [7, 8], [20, 21])
            assert same_bytes(connector.kv_cache[20:22], expected[7:9]), connector.backend_name

        peer.signal(signal.SIGKILL)
        for connector, peer_id in zip(connectors, peer_ids, strict=True):
            start = time.monotonic()
            with pytest.raises(KVTransferError):
                connector.pull(peer_id, [5, 6], [5, 6])
            assert time.monotonic() - start < 3.0, connector.backend_name
            assert connector.failures_total == 2
    finally:
        for connector in connectors:
            connector.close()
        if peer.proc.poll() is None:
            peer.signal(signal.SIGKILL)
        peer.stop()


@pytest.mark.skipif(not HAS_NIXL, reason="NIXL does not import")
def test_idle_nixl_agent_leaves_the_cpu_alone():
    """The agent's progress thread waits on its event fds instead of polling with a zero timeout."""
    peer = PeerProcess([spec("nixl", "float32")])
    try:
        assert peer.metadata  # the agent is up, its KV registered

        def cpu_seconds() -> float:
            fields = Path(f"/proc/{peer.proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
            return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

        before, start = cpu_seconds(), time.monotonic()
        while time.monotonic() - start < 2.0:
            time.sleep(0.1)
        busy = (cpu_seconds() - before) / (time.monotonic() - start)
        assert busy < 0.25, f"an idle NIXL peer used {busy:.0%} of a core"  # a busy-polling thread: ~100%
    finally:
        peer.stop()
