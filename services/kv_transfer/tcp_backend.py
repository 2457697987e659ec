"""Plain-TCP KV connector, for machines where NIXL cannot be installed.

Each connector serves its blocks from a small TCP server (one thread per
connection); a pull sends the merged runs it wants and receives their raw bytes
straight into the local kv_cache memory (CUDA caches go through a host
staging buffer). One cached connection per peer, guarded by a lock.

Wire format, version 1 (network byte order):
    request:  magic b"CKVQ", u16 version, u32 num_runs, u64 block_bytes,
              then num_runs x (u32 remote_start, u32 num_blocks)
    response: magic b"CKVR", u16 version, u16 status (0 ok, 1 error), u64 payload_len,
              then the blocks of every run in request order, or a UTF-8 error message
"""

from __future__ import annotations

import logging
import socket
import struct
import threading
import time
from typing import Any

import torch

from services.kv_transfer.connector import DEFAULT_TIMEOUT_S, BlockRun, KVConnector, KVTransferError, RemotePeer
from services.kv_transfer.handshake import KVCompatibilityError, PeerInfo

logger = logging.getLogger(__name__)

WIRE_VERSION = 1
_REQUEST = struct.Struct("!4sHIQ")
_RUN = struct.Struct("!II")
_RESPONSE = struct.Struct("!4sHHQ")
_REQUEST_MAGIC = b"CKVQ"
_RESPONSE_MAGIC = b"CKVR"
_STATUS_OK = 0
_STATUS_ERROR = 1


def _host_bytes(kv_cache: torch.Tensor) -> memoryview | None:
    """Flat byte view of a CPU kv_cache's memory (no copy); None for device tensors."""
    if kv_cache.is_cuda:
        return None
    return kv_cache.view(-1).view(torch.uint8).numpy().data


def _recv_exact(sock: socket.socket, view: memoryview, deadline: float | None, what: str) -> None:
    """Fill `view` from `sock`; a deadline of None waits forever (idle server connections)."""
    total = len(view)
    received = 0
    while received < total:
        if deadline is not None:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError
            sock.settimeout(remaining)
        count = sock.recv_into(view[received:], total - received)
        if count == 0:
            raise ConnectionError(f"connection closed after {received} of {total} bytes of {what}")
        received += count


class _BlockServer:
    """Answers block requests from peers with the raw bytes of those blocks."""

    def __init__(self, kv_cache: torch.Tensor, block_bytes: int, host: str, timeout_s: float) -> None:
        self.kv_cache = kv_cache
        self.block_bytes = block_bytes
        self.num_blocks = kv_cache.shape[0]
        self.timeout_s = timeout_s
        self._host_bytes = _host_bytes(kv_cache)
        self._sock = socket.create_server((host, 0))
        self.port: int = self._sock.getsockname()[1]
        self._conns: set[socket.socket] = set()
        self._lock = threading.Lock()
        self._closed = False
        self._thread = threading.Thread(target=self._accept_loop, name=f"kv-tcp-accept-{self.port}", daemon=True)
        self._thread.start()

    def _accept_loop(self) -> None:
        while True:
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return  # closed
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            with self._lock:
                if self._closed:
                    conn.close()
                    return
                self._conns.add(conn)
            threading.Thread(target=self._serve, args=(conn,), name="kv-tcp-serve", daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        try:
            while self._serve_one(conn):
                pass
        except OSError as exc:
            logger.debug("kv_tcp_serve_closed error=%r", exc)
        finally:
            with self._lock:
                self._conns.discard(conn)
            conn.close()

    def _serve_one(self, conn: socket.socket) -> bool:
        header = bytearray(_REQUEST.size)
        conn.settimeout(None)
        try:
            _recv_exact(conn, memoryview(header), None, "request header")
        except ConnectionError:
            return False  # the peer closed its cached connection
        magic, version, num_runs, block_bytes = _REQUEST.unpack(header)
        if magic != _REQUEST_MAGIC or version != WIRE_VERSION:
            self._send_error(conn, f"bad request header (magic {magic!r}, version {version}); ours is v{WIRE_VERSION}")
            return False
        if num_runs > self.num_blocks or block_bytes != self.block_bytes:
            self._send_error(
                conn, f"{num_runs} runs of {block_bytes}-byte blocks; serving {self.block_bytes}-byte blocks"
            )
            return False
        body = bytearray(num_runs * _RUN.size)
        _recv_exact(conn, memoryview(body), time.monotonic() + self.timeout_s, "request body")
        runs = [_RUN.unpack_from(body, i * _RUN.size) for i in range(num_runs)]  # (remote_start, num_blocks)
        if any(start + count > self.num_blocks for start, count in runs):
            self._send_error(conn, f"block ids out of range: this worker has {self.num_blocks} blocks")
            return True
        conn.settimeout(self.timeout_s)
        payload_len = sum(count for _, count in runs) * self.block_bytes
        conn.sendall(_RESPONSE.pack(_RESPONSE_MAGIC, WIRE_VERSION, _STATUS_OK, payload_len))
        for start, count in runs:
            conn.sendall(self._run_bytes(start, count))
        return True

    def _run_bytes(self, start: int, count: int) -> memoryview:
        begin, end = start * self.block_bytes, (start + count) * self.block_bytes
        if self._host_bytes is not None:
            return self._host_bytes[begin:end]
        # [count * block_bytes] bytes of the device blocks, copied to host
        return self.kv_cache[start : start + count].reshape(-1).view(torch.uint8).cpu().numpy().data

    def _send_error(self, conn: socket.socket, message: str) -> None:
        data = message.encode("utf-8")
        conn.settimeout(self.timeout_s)
        conn.sendall(_RESPONSE.pack(_RESPONSE_MAGIC, WIRE_VERSION, _STATUS_ERROR, len(data)) + data)

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            conns = list(self._conns)
        try:
            self._sock.shutdown(socket.SHUT_RDWR)  # wakes accept()
        except OSError:
            pass
        self._sock.close()
        for conn in conns:
            try:
                conn.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        self._thread.join(timeout=1.0)


class _PeerConnection:
    """Cached client socket to one peer; the lock serialises pulls over it."""

    def __init__(self, host: str, port: int) -> None:
        self.host = host
        self.port = port
        self.lock = threading.Lock()
        self.sock: socket.socket | None = None

    def reset(self) -> None:
        if self.sock is not None:
            self.sock.close()
            self.sock = None


class TcpConnector(KVConnector):
    """KV connector over plain TCP sockets."""

    backend_name = "tcp"

    def __init__(
        self,
        kv_cache: torch.Tensor,
        peer_info: PeerInfo,
        host: str = "127.0.0.1",
        timeout_s: float = DEFAULT_TIMEOUT_S,
        local_reads: bool = True,
    ) -> None:
        super().__init__(kv_cache, peer_info, timeout_s=timeout_s, local_reads=local_reads)
        self._host_bytes = _host_bytes(kv_cache)
        self._server = _BlockServer(kv_cache, self.block_bytes, host, timeout_s)
        self.host = socket.gethostname() if host in ("", "0.0.0.0", "::") else host
        self.port = self._server.port
        self._connections: dict[str, _PeerConnection] = {}
        self._closed = False
        logger.info("kv_tcp_server_ready name=%s endpoint=%s:%d", self.name, self.host, self.port)

    def _backend_metadata(self) -> dict[str, Any]:
        return {"host": self.host, "port": self.port}

    def _connect_peer(self, peer: RemotePeer) -> None:
        host, port = peer.payload.get("host"), peer.payload.get("port")
        if not isinstance(host, str) or not isinstance(port, int):
            raise KVCompatibilityError(f"TCP metadata of peer {peer.peer_id} lacks host/port")
        with self._lock:
            self._connections.setdefault(peer.peer_id, _PeerConnection(host, port))

    def _disconnect_peer(self, peer: RemotePeer) -> None:
        with self._lock:
            connection = self._connections.pop(peer.peer_id, None)
        if connection is not None:
            with connection.lock:
                connection.reset()

    def _read_runs(self, peer: RemotePeer, runs: list[BlockRun]) -> None:
        with self._lock:
            if self._closed:
                raise KVTransferError("TCP KV connector is closed")
            connection = self._connections.get(peer.peer_id)
        if connection is None:
            raise KVTransferError(f"KV peer {peer.peer_id!r} was removed")
        deadline = time.monotonic() + self.timeout_s
        endpoint = f"{connection.host}:{connection.port}"
        with connection.lock:
            try:
                self._exchange(connection, runs, deadline)
            except KVTransferError:
                connection.reset()
                raise
            except TimeoutError as exc:
                connection.reset()
                raise KVTransferError(
                    f"TCP pull from peer {peer.peer_id} ({endpoint}) did not finish within {self.timeout_s:g} s"
                ) from exc
            except OSError as exc:
                connection.reset()
                raise KVTransferError(f"TCP pull from peer {peer.peer_id} ({endpoint}) failed: {exc}") from exc

    def _exchange(self, connection: _PeerConnection, runs: list[BlockRun], deadline: float) -> None:
        if connection.sock is None:
            address = (connection.host, connection.port)
            connection.sock = socket.create_connection(address, timeout=max(deadline - time.monotonic(), 1e-3))
            connection.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock = connection.sock
        request = _REQUEST.pack(_REQUEST_MAGIC, WIRE_VERSION, len(runs), self.block_bytes)
        request += b"".join(_RUN.pack(run.remote_start, run.num_blocks) for run in runs)
        sock.settimeout(max(deadline - time.monotonic(), 1e-3))
        sock.sendall(request)
        header = bytearray(_RESPONSE.size)
        _recv_exact(sock, memoryview(header), deadline, "response header")
        magic, version, status, payload_len = _RESPONSE.unpack(header)
        if magic != _RESPONSE_MAGIC or version != WIRE_VERSION:
            raise KVTransferError(f"peer answered with magic {magic!r} version {version}; expected v{WIRE_VERSION}")
        if status != _STATUS_OK:
            message = bytearray(min(payload_len, 1 << 16))
            _recv_exact(sock, memoryview(message), deadline, "error message")
            raise KVTransferError(f"peer refused the pull: {message.decode('utf-8', 'replace')}")
        expected = sum(run.num_blocks for run in runs) * self.block_bytes
        if payload_len != expected:
            raise KVTransferError(f"peer announced {payload_len} bytes, expected {expected}")
        for run in runs:
            self._recv_run(sock, run, deadline)

    def _recv_run(self, sock: socket.socket, run: BlockRun, deadline: float) -> None:
        begin = run.local_start * self.block_bytes
        end = begin + run.num_blocks * self.block_bytes
        if self._host_bytes is not None:
            _recv_exact(sock, self._host_bytes[begin:end], deadline, "KV blocks")
            return
        staging = torch.empty(end - begin, dtype=torch.uint8, pin_memory=True)
        _recv_exact(sock, staging.numpy().data, deadline, "KV blocks")
        # [num_blocks * block_bytes] bytes into the device blocks
        local_blocks = self.kv_cache[run.local_start : run.local_start + run.num_blocks]
        local_blocks.reshape(-1).view(torch.uint8).copy_(staging)

    def _close_backend(self) -> None:
        self._server.close()
        with self._lock:
            self._closed = True
            connections = list(self._connections.values())
        for connection in connections:
            sock = connection.sock
            if sock is not None:
                try:
                    sock.shutdown(socket.SHUT_RDWR)  # fails a pull in progress instead of waiting for it
                except OSError:
                    pass
