"""The engine's ``KVTransport`` over this worker's ``KVConnector`` (NIXL or TCP)."""

from __future__ import annotations

from collections.abc import Callable

from services.kv_transfer.connector import KVConnector
from shared.engine.kv_connector import LoadResult, RemoteKV


class ConnectorTransport:
    """Pulls go through the connector; a release goes to ``release`` (the service's gRPC call, non-blocking)."""

    def __init__(self, connector: KVConnector, release: Callable[[RemoteKV], None]) -> None:
        self.connector = connector
        self._release = release

    def pull(self, peer_id: str, remote_block_ids: list[int], local_block_ids: list[int]) -> LoadResult:
        stats = self.connector.pull(peer_id, remote_block_ids, local_block_ids)
        return LoadResult(num_bytes=stats.num_bytes, seconds=stats.seconds, num_descriptors=stats.num_descriptors)

    def release(self, remote: RemoteKV) -> None:
        self._release(remote)
