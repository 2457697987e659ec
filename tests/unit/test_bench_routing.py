"""``python -m shared.bench.routing``: argument handling and the report it builds (no cluster started)."""

from __future__ import annotations

import pytest

from shared.bench.routing import parse_args, policy_medians, report_row, run_order


def test_flags_split_between_script_workers_and_bench_serve():
    argv = ["--model", "m", "--policies", "kv_aware", "least_loaded", "--rounds", "3", "--kv-cache-memory", "36MiB",
            "--router-arg=--kv-overlap-weight=2", "--", "--prefix-groups", "8", "--num-prompts", "120"]  # fmt: skip
    args, worker_args, bench_args = parse_args(argv)
    assert (args.model, args.policies, args.rounds) == ("m", ["kv_aware", "least_loaded"], 3)
    assert (args.prefill_workers, args.decode_workers) == (2, 2)
    assert args.router_arg == ["--kv-overlap-weight=2"]
    assert worker_args == ["--kv-cache-memory", "36MiB"]
    assert bench_args == ["--prefix-groups", "8", "--num-prompts", "120"]


def test_defaults_and_refusals():
    args, worker_args, bench_args = parse_args(["--model", "m"])
    assert args.policies == ["kv_aware", "least_loaded", "round_robin"] and args.rounds == 2
    assert worker_args == [] and bench_args == []
    for bad in (["--rounds", "0"], ["--policies", "random"], ["--decode-workers", "0"]):
        with pytest.raises(SystemExit):
            parse_args(["--model", "m", *bad])


def test_runs_interleave_policies_round_by_round():
    assert run_order(["a", "b", "c"], 2) == [(1, "a"), (1, "b"), (1, "c"), (2, "a"), (2, "b"), (2, "c")]


def test_rows_take_the_table_columns_and_medians_go_per_policy():
    report = {"prefix_hit_rate": 0.8, "ideal_prefix_hit_rate": 0.9, "prefix_hit_rate_vs_ideal": 0.889,
              "median_ttft_ms": 40.0, "p99_ttft_ms": 300.0, "output_throughput": 30.0,
              "kv_transfer_bytes_per_request": 1000.0, "completed": 120, "failed": 0, "mean_ttft_ms": 90.0,
              "mean_tpot_ms": 1.0}  # fmt: skip
    row = report_row("kv_aware", 1, report)
    assert row == {"policy": "kv_aware", "round": 1, "prefix_hit_rate": 0.8, "ideal_prefix_hit_rate": 0.9,
                   "hit_rate_vs_ideal": 0.889, "ttft_mean_ms": 90.0, "ttft_p50_ms": 40.0, "ttft_p99_ms": 300.0, "output_tok_s": 30.0,
                   "kv_bytes_per_request": 1000.0, "completed": 120, "failed": 0}  # fmt: skip
    # Without --worker-metrics the hit-rate columns are absent: None, and left out of the medians.
    rows = [row, report_row("kv_aware", 2, {**report, "median_ttft_ms": 60.0}), report_row("round_robin", 1, {})]
    medians = policy_medians(rows)
    assert [m["policy"] for m in medians] == ["kv_aware", "round_robin"]
    assert medians[0]["rounds"] == 2 and medians[0]["ttft_p50_ms"] == 50.0 and medians[0]["completed"] == 120
    assert medians[1]["ttft_p50_ms"] is None
