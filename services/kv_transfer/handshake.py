"""KV transfer handshake: protocol version, compatibility hash and peer checks.

Before a decode worker reads KV blocks from a prefill worker, both sides
exchange a `PeerInfo`. A transfer is only allowed when the protocol versions,
the transfer backends and the KV geometry (model, dtype, block size, layer and
head shape) agree; anything else would silently copy bytes that mean something
different on the two sides. Pure Python: no torch, no I/O.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass

PROTOCOL_VERSION = 1

# Geometry fields covered by the compatibility hash, with the remedy an
# operator needs when they differ.
_GEOMETRY_REMEDIES: dict[str, str] = {
    "model_id": "serve the same model on both (--model)",
    "dtype": "start both with the same --dtype and --kv-cache-dtype",
    "block_size": "start both with the same --block-size",
    "num_layers": "serve the same model checkpoint on both",
    "num_kv_heads": "serve the same model checkpoint on both (and the same tensor-parallel size)",
    "head_dim": "serve the same model checkpoint on both",
}


class KVCompatibilityError(RuntimeError):
    """The two workers' KV caches cannot exchange blocks; the message says why and what to do."""


def compat_hash(model_id: str, dtype: str, block_size: int, num_layers: int, num_kv_heads: int, head_dim: int) -> str:
    """Short, stable hex digest of the KV geometry (same value in every process and Python version)."""
    canonical = json.dumps(
        {
            "model_id": model_id,
            "dtype": dtype,
            "block_size": int(block_size),
            "num_layers": int(num_layers),
            "num_kv_heads": int(num_kv_heads),
            "head_dim": int(head_dim),
        },
        sort_keys=True,
        separators=(",", ":"),
    )
    return hashlib.sha256(canonical.encode("utf-8")).hexdigest()[:16]


def parse_metadata_json(data: bytes) -> object:
    """Peer metadata bytes as JSON; anything else is refused as incompatible."""
    try:
        return json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise KVCompatibilityError(
            f"peer KV metadata is not valid JSON ({exc}): run the same Cleave version on all workers"
        ) from exc


@dataclass(frozen=True)
class PeerInfo:
    """What one worker tells another about its KV cache before any block moves."""

    protocol_version: int
    compat_hash: str
    backend: str  # "nixl" or "tcp"
    model_id: str
    dtype: str  # e.g. "bfloat16"
    block_size: int
    num_layers: int
    num_kv_heads: int
    head_dim: int
    role: str = ""  # "prefill" or "decode"; only used to word error messages

    @classmethod
    def create(
        cls,
        *,
        model_id: str,
        dtype: str,
        block_size: int,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        backend: str = "",
        role: str = "",
    ) -> PeerInfo:
        """PeerInfo for this process, with the current protocol version and a freshly computed hash."""
        return cls(
            protocol_version=PROTOCOL_VERSION,
            compat_hash=compat_hash(model_id, dtype, block_size, num_layers, num_kv_heads, head_dim),
            backend=backend,
            model_id=model_id,
            dtype=dtype,
            block_size=int(block_size),
            num_layers=int(num_layers),
            num_kv_heads=int(num_kv_heads),
            head_dim=int(head_dim),
            role=role,
        )

    def with_backend(self, backend: str) -> PeerInfo:
        return dataclasses.replace(self, backend=backend)

    def to_dict(self) -> dict[str, object]:
        return dataclasses.asdict(self)

    def to_json(self) -> bytes:
        return json.dumps(self.to_dict(), sort_keys=True, separators=(",", ":")).encode("utf-8")

    @classmethod
    def from_dict(cls, fields: object) -> PeerInfo:
        """Parse a peer's fields; unknown keys are ignored so newer peers can add fields."""
        if not isinstance(fields, dict):
            raise KVCompatibilityError(
                "peer KV metadata is not a JSON object: the peer runs an incompatible Cleave version; "
                "run the same Cleave version on all workers"
            )
        kwargs: dict[str, object] = {}
        for field in dataclasses.fields(cls):
            if field.name in fields:
                kwargs[field.name] = fields[field.name]
            elif field.default is dataclasses.MISSING:
                version = fields.get("protocol_version", "unknown")
                raise KVCompatibilityError(
                    f"peer KV metadata (protocol version {version}) lacks field {field.name!r}; "
                    f"this worker speaks protocol {PROTOCOL_VERSION}: run the same Cleave version on all workers"
                )
        for name in ("protocol_version", "block_size", "num_layers", "num_kv_heads", "head_dim"):
            if not isinstance(kwargs[name], int):
                raise KVCompatibilityError(f"peer KV metadata field {name!r} is not an integer: {kwargs[name]!r}")
        return cls(**kwargs)  # type: ignore[arg-type]

    @classmethod
    def from_json(cls, data: bytes) -> PeerInfo:
        return cls.from_dict(parse_metadata_json(data))


def _worker(info: PeerInfo, fallback: str) -> str:
    return f"{info.role} worker" if info.role else fallback


def check_peer(local: PeerInfo, remote: PeerInfo) -> None:
    """Raise KVCompatibilityError unless blocks can move between `remote` and `local`."""
    there = _worker(remote, "peer worker")
    here = "this " + _worker(local, "worker")
    if remote.protocol_version != local.protocol_version:
        raise KVCompatibilityError(
            f"{there} speaks KV transfer protocol {remote.protocol_version}, {here} {local.protocol_version}: "
            "run the same Cleave version on all workers"
        )
    if remote.backend != local.backend:
        raise KVCompatibilityError(
            f"{there} uses KV transfer backend {remote.backend!r}, {here} {local.backend!r}: "
            "start both with the same --kv-transfer-backend (or install NIXL on both)"
        )
    differences = [
        f"{there} uses {name} {getattr(remote, name)!r}, {here} {getattr(local, name)!r}: {remedy}"
        for name, remedy in _GEOMETRY_REMEDIES.items()
        if getattr(remote, name) != getattr(local, name)
    ]
    if differences:
        raise KVCompatibilityError("KV caches are incompatible: " + "; ".join(differences))
    if remote.compat_hash != local.compat_hash:
        raise KVCompatibilityError(
            f"{there} has KV compatibility hash {remote.compat_hash}, {here} {local.compat_hash}, "
            "although model, dtype and geometry agree: run the same Cleave version on all workers"
        )
