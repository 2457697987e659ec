"""A stand-in prefill worker for KV transfer tests, run as its own process.

Usage: python peer_proc.py '<json list of specs>'
Each spec {"backend", "dtype", "block_size", "seed", "device"} gets a kv_cache
of shape [32, 2, 2, block_size, 2, 8] filled by `fill_kv_cache` and a
connector over it. Once all are ready the process prints one line,
`KV_PEER_METADATA <base64 of a JSON list of base64 metadata>`, then serves
reads until its stdin closes (so it never outlives the test).
"""

from __future__ import annotations

import base64
import json
import logging
import sys

import torch

from services.kv_transfer.connector import create_connector, make_peer_info

MODEL_ID = "test/kv-transfer-model"
NUM_BLOCKS, NUM_LAYERS, NUM_KV_HEADS, HEAD_DIM = 32, 2, 2, 8
METADATA_PREFIX = "KV_PEER_METADATA "


def kv_shape(block_size: int) -> tuple[int, ...]:
    # [num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim]
    return (NUM_BLOCKS, NUM_LAYERS, 2, block_size, NUM_KV_HEADS, HEAD_DIM)


def fill_kv_cache(block_size: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Known, distinct values for every element, reproducible in any process."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(kv_shape(block_size), generator=generator).to(dtype)


def main() -> None:
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    specs = json.loads(sys.argv[1])
    connectors = []
    for spec in specs:
        kv_cache = fill_kv_cache(spec["block_size"], getattr(torch, spec["dtype"]), spec["seed"])
        kv_cache = kv_cache.to(spec.get("device", "cpu"))
        peer_info = make_peer_info(kv_cache, model_id=MODEL_ID, role="prefill")
        connectors.append(create_connector(kv_cache, peer_info, backend=spec["backend"]))
    metadata = [base64.b64encode(c.local_metadata()).decode("ascii") for c in connectors]
    encoded = base64.b64encode(json.dumps(metadata).encode()).decode("ascii")
    print(METADATA_PREFIX + encoded, flush=True)
    sys.stdin.read()  # serve until the test closes our stdin
    for connector in connectors:
        connector.close()


if __name__ == "__main__":
    main()
