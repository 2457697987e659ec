"""The router's KV index (exact contents, prefix overlap, memory bound) and the kv_aware cost choice."""

from __future__ import annotations

import random

from services.common.kv_events import EventBatch
from services.router.kv_index import KVIndex, hashes_digest
from services.router.kv_routing import pick_by_cost
from shared.engine.prefix_hash import block_hashes


def h(i: int) -> bytes:
    return i.to_bytes(16, "big")


def test_store_remove_clear_and_overlap():
    index = KVIndex()
    index.store("a", [h(1), h(2), h(3)])
    index.store("b", [h(1), h(3)])
    assert index.prefix_overlap([h(1), h(2), h(3)]) == {"a": 3, "b": 1}  # b lacks block 2: only 1 counts
    index.remove("a", [h(2), h(9)])
    assert index.prefix_overlap([h(1), h(2), h(3)]) == {"a": 1, "b": 1}
    assert index.worker_hashes("a") == {h(1), h(3)}
    index.clear_worker("b")
    assert index.prefix_overlap([h(1)]) == {"a": 1} and len(index) == 2
    assert index.prefix_overlap([h(7)]) == {}


def test_memory_bound_drops_oldest_entries():
    index = KVIndex(max_entries=3)
    index.store("a", [h(1), h(2)])
    index.store("b", [h(3)])
    index.store("a", [h(1)])  # refreshed: now the newest
    index.store("b", [h(4)])
    assert len(index) == 3 and index.num_dropped == 1
    assert index.worker_hashes("a") == {h(1)} and index.worker_hashes("b") == {h(3), h(4)}


def test_summary_digest_is_order_free():
    index = KVIndex()
    index.store("a", [h(2), h(1)])
    assert index.summary()["workers"]["a"] == {"blocks": 2, "digest": hashes_digest([h(1), h(2)])}


def test_event_batch_round_trip():
    stored = block_hashes(list(range(64)), 16)
    batch = EventBatch(7, False, 16, stored, stored[:1])
    assert EventBatch.from_fields(batch.to_fields()) == batch


def test_pick_by_cost_cheapest_first_among_ties_and_temperature_spreads():
    rng = random.Random(0)
    assert pick_by_cost(["x", "y", "z"], [3.0, 1.0, 1.0], 0.0, rng) == "y"  # type: ignore[list-item]
    picks = [pick_by_cost(["x", "y"], [1.0, 1.01], 1.0, rng) for _ in range(200)]  # type: ignore[list-item]
    assert 50 < picks.count("x") < 150  # near-equals share the load
    picks = [pick_by_cost(["x", "y"], [0.0, 100.0], 0.05, rng) for _ in range(200)]  # type: ignore[list-item]
    assert picks.count("x") == 200


def test_index_micro_benchmark_runs(capsys):
    import json

    from services.router.kv_index_bench import main

    assert main(["--workers", "20", "--blocks-per-worker", "8", "--groups", "4", "--decisions", "5"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["index_entries"] == 20 * 8 and report["total"]["median_us"] > 0


def test_shared_prefix_workload_and_its_ideal_hits():
    from shared.bench.workload import ideal_prefix_hit_blocks, make_prefix_workload

    requests, groups = make_prefix_workload(12, 3, 64, (5, 9), (2, 4), vocab_size=50, seed=1)
    assert len(requests) == 12 and set(groups) <= {0, 1, 2}
    for req, group in zip(requests, groups, strict=True):
        first = next(r for r, g in zip(requests, groups, strict=True) if g == group)
        assert req.prompt_token_ids[:64] == first.prompt_token_ids[:64]
        assert 69 <= len(req.prompt_token_ids) <= 73
    assert ideal_prefix_hit_blocks(requests, groups, 64, 16) == 4 * (12 - len(set(groups)))
