"""``python -m services.router.kv_index_bench``: the router's added latency per kv_aware decision.

Fills a ``KVIndex`` as ``--workers`` workers with ``--blocks-per-worker`` cached
blocks each would (groups of workers share prefixes), then times what routing
adds to one request: hashing a ``--prompt-len`` prompt, its prefix overlap
against the index, and the cost choice over every worker. Prints JSON (µs).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from dataclasses import dataclass

from services.router.kv_index import KVIndex
from services.router.kv_routing import KVRouter, PromptBlocks
from shared.engine.prefix_hash import block_hashes


@dataclass
class _Entry:
    worker_id: str


@dataclass
class _Candidate:
    """What the cost function reads of a worker (no gRPC channel: a thousand of them would cost more)."""

    entry: _Entry
    in_flight_blocks: int = 0
    load: None = None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m services.router.kv_index_bench", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    parser.add_argument("--workers", type=int, default=1000)
    parser.add_argument("--blocks-per-worker", type=int, default=256)
    parser.add_argument("--prompt-len", type=int, default=1024)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--groups", type=int, default=64, help="distinct prefixes cached across the fleet")
    parser.add_argument("--decisions", type=int, default=200)
    args = parser.parse_args(argv)
    rng = random.Random(0)
    prefixes = [[rng.randrange(1000) for _ in range(args.blocks_per_worker * args.block_size)]
                for _ in range(args.groups)]  # fmt: skip
    prefix_hashes = [block_hashes(p, args.block_size) for p in prefixes]
    index = KVIndex(max_entries=args.workers * args.blocks_per_worker)
    t0 = time.perf_counter()
    for w in range(args.workers):
        index.store(f"w{w}", prefix_hashes[w % args.groups])
    fill_s = time.perf_counter() - t0
    router = KVRouter(index, watcher=None, temperature=0.0)  # type: ignore[arg-type]
    candidates = [_Candidate(_Entry(f"w{w}"), in_flight_blocks=rng.randrange(64)) for w in range(args.workers)]
    timings: dict[str, list[float]] = {"hash": [], "choose": [], "total": []}
    for _ in range(args.decisions):
        group = rng.randrange(args.groups)
        prompt = prefixes[group][: args.prompt_len // 2] + [rng.randrange(1000) for _ in range(args.prompt_len // 2)]
        t0 = time.perf_counter()
        blocks = PromptBlocks(block_hashes(prompt, args.block_size), args.block_size)
        t1 = time.perf_counter()
        router.chooser(blocks)(candidates)  # type: ignore[arg-type]
        t2 = time.perf_counter()
        timings["hash"].append(t1 - t0)
        timings["choose"].append(t2 - t1)
        timings["total"].append(t2 - t0)

    def summary(values: list[float]) -> dict[str, float]:
        us = sorted(v * 1e6 for v in values)
        return {"median_us": round(statistics.median(us), 1), "p99_us": round(us[int(0.99 * (len(us) - 1))], 1)}

    report = {"workers": args.workers, "index_entries": len(index), "prompt_len": args.prompt_len,
              "index_fill_s": round(fill_s, 2), **{k: summary(v) for k, v in timings.items()}}  # fmt: skip
    json.dump(report, sys.stdout, indent=2)
    print()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
