"""Worker metrics: one registry per instance, request histograms observed from deltas."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from services.common.metrics import WorkerMetrics
from shared.engine.engine_core import EngineStats, RequestOutputDelta
from shared.engine.request import Request
from shared.engine.sampling_params import SamplingParams


def samples(metrics: WorkerMetrics) -> dict[str, float]:
    text = metrics.render().decode()
    return {
        s.name
        + ("{" + s.labels["le"] + "}" if "le" in s.labels else "")
        + (f"[{s.labels['finished_reason']}]" if "finished_reason" in s.labels else ""): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def make(worker_id: str = "w1") -> WorkerMetrics:
    return WorkerMetrics("decode", worker_id, block_size=16, num_blocks=64, backend="tcp")


def test_two_workers_in_one_process_keep_their_own_series():
    a, b = make("a"), make("b")
    a.kv_failures.inc()
    assert samples(a)["cleave_kv_transfer_failures_total"] == 1
    assert samples(b)["cleave_kv_transfer_failures_total"] == 0
    assert 'worker_id="b"' not in a.render().decode()
    assert "python_gc" not in a.render().decode()  # no process-global collectors


def test_request_histograms_follow_the_deltas():
    metrics = make()
    req = Request("r1", list(range(20)), SamplingParams(max_tokens=3))
    req.arrival_time -= 0.5  # arrived half a second ago
    req.scheduled_time = req.arrival_time + 0.2
    tracker = metrics.tracker(req)
    for i in range(3):
        last = i == 2
        tracker.on_delta(RequestOutputDelta("r1", [i], finished=last, finish_reason="length" if last else None,
                                            num_prompt_tokens=20))  # fmt: skip
    s = samples(metrics)
    assert s["cleave_time_to_first_token_seconds_count"] == 1 and s["cleave_time_to_first_token_seconds_sum"] >= 0.5
    assert (
        s["cleave_request_queue_time_seconds_sum"] == 0.2
        or abs(s["cleave_request_queue_time_seconds_sum"] - 0.2) < 1e-6
    )
    assert s["cleave_inter_token_latency_seconds_count"] == 2
    assert s["cleave_request_time_per_output_token_seconds_count"] == 1
    assert s["cleave_request_success_total[length]"] == 1
    assert s["cleave_request_prompt_tokens_sum"] == 20 and s["cleave_request_generation_tokens_sum"] == 3
    assert s["cleave_e2e_request_latency_seconds_count"] == 1


def test_engine_snapshot_counts_prefix_cache_in_tokens_and_only_moves_forward():
    metrics = make()
    stats = EngineStats(num_running=2, num_waiting=1, num_free_blocks=60, num_total_blocks=64, kv_cache_usage=0.0625,
                        prefix_cache_queries=4, prefix_cache_hits=1, num_preemptions=0,
                        num_prompt_tokens_computed=48, num_generation_tokens=5)  # fmt: skip
    metrics.update(stats, num_leased=0)
    metrics.update(stats, num_leased=0)
    metrics.observe_step(7)
    s = samples(metrics)
    assert s["cleave_num_requests_running"] == 2 and s["cleave_num_requests_waiting"] == 1
    assert s["cleave_prefix_cache_queries_total"] == 64 and s["cleave_prefix_cache_hits_total"] == 16
    assert s["cleave_prompt_tokens_total"] == 48 and s["cleave_generation_tokens_total"] == 5
    assert s["cleave_iteration_tokens_count"] == 1 and s["cleave_iteration_tokens_sum"] == 7
    assert s["cleave_cache_config_info"] == 1
