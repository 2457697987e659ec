"""KV transfer handshake: compatibility hash, PeerInfo wire form, peer checks."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys

import pytest

from services.kv_transfer.handshake import PROTOCOL_VERSION, KVCompatibilityError, PeerInfo, check_peer, compat_hash

GEOMETRY = {
    "model_id": "meta-llama/Llama-3.2-1B",
    "dtype": "bfloat16",
    "block_size": 16,
    "num_layers": 16,
    "num_kv_heads": 8,
    "head_dim": 64,
}


def peer(role: str = "", backend: str = "nixl", **overrides) -> PeerInfo:
    return PeerInfo.create(**{**GEOMETRY, **overrides}, backend=backend, role=role)


def test_compat_hash_is_stable_short_hex():
    value = compat_hash(**GEOMETRY)
    assert value == compat_hash(**GEOMETRY)
    assert len(value) == 16 and int(value, 16) >= 0
    # Pinned: the hash crosses processes and versions, so it must never change by accident.
    assert value == "f992798f52424928"


@pytest.mark.parametrize(
    "field, value",
    [
        ("model_id", "other/model"),
        ("dtype", "float16"),
        ("block_size", 32),
        ("num_layers", 17),
        ("num_kv_heads", 4),
        ("head_dim", 128),
    ],
)
def test_compat_hash_covers_every_geometry_field(field, value):
    assert compat_hash(**{**GEOMETRY, field: value}) != compat_hash(**GEOMETRY)


def test_peer_info_round_trips_through_json():
    info = peer(role="prefill")
    assert info.protocol_version == PROTOCOL_VERSION
    assert info.compat_hash == compat_hash(**GEOMETRY)
    assert PeerInfo.from_json(info.to_json()) == info
    assert json.loads(info.to_json())["block_size"] == 16


def test_peer_info_ignores_unknown_fields_and_rejects_missing_ones():
    fields = peer().to_dict()
    assert PeerInfo.from_dict({**fields, "added_in_v2": True}) == peer()
    assert PeerInfo.from_dict({k: v for k, v in fields.items() if k != "role"}) == peer()
    with pytest.raises(KVCompatibilityError, match="lacks field 'block_size'"):
        PeerInfo.from_dict({k: v for k, v in fields.items() if k != "block_size"})
    with pytest.raises(KVCompatibilityError, match="not an integer"):
        PeerInfo.from_dict({**fields, "block_size": "16"})
    with pytest.raises(KVCompatibilityError, match="not valid JSON"):
        PeerInfo.from_json(b"{nope")
    with pytest.raises(KVCompatibilityError, match="not a JSON object"):
        PeerInfo.from_json(b"[1, 2]")


def test_matching_peers_pass():
    check_peer(peer(role="decode"), peer(role="prefill"))


def test_block_size_mismatch_names_both_values_and_the_flag():
    with pytest.raises(KVCompatibilityError) as info:
        check_peer(peer(role="decode", block_size=16), peer(role="prefill", block_size=32))
    assert "prefill worker uses block_size 32, this decode worker 16: start both with the same --block-size" in str(
        info.value
    )


def test_every_difference_is_listed():
    with pytest.raises(KVCompatibilityError) as info:
        check_peer(peer(dtype="float16", head_dim=128), peer())
    message = str(info.value)
    assert (
        "peer worker uses dtype 'bfloat16', this worker 'float16': start both with the same --dtype and --kv-cache-dtype"
        in message
    )
    assert "head_dim 64, this worker 128" in message


def test_protocol_version_mismatch():
    remote = dataclasses.replace(peer(role="prefill"), protocol_version=PROTOCOL_VERSION + 1)
    with pytest.raises(KVCompatibilityError, match=f"protocol {PROTOCOL_VERSION + 1}, this decode worker 1"):
        check_peer(peer(role="decode"), remote)


def test_backend_mismatch():
    with pytest.raises(KVCompatibilityError, match="backend 'tcp', this worker 'nixl'.*--kv-transfer-backend"):
        check_peer(peer(backend="nixl"), peer(backend="tcp"))


def test_hash_mismatch_with_equal_geometry():
    remote = dataclasses.replace(peer(), compat_hash="0123456789abcdef")
    with pytest.raises(KVCompatibilityError, match="compatibility hash 0123456789abcdef.*same Cleave version"):
        check_peer(peer(), remote)


def test_handshake_imports_no_torch():
    code = "import sys, services.kv_transfer.handshake; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)
