"""Write Cleave's Grafana dashboard (``deploy/grafana/dashboards/cleave.json``).

Rows follow a request: overview, prefill pool, KV transfer, decode pool,
router. Every panel has a unit and a description; queries use the template
variables ``$pool`` (worker role) and ``$instance`` (scrape target). The JSON
is generated so that a test can check it is fresh and evaluate every query
against a real Prometheus:

    python -m shared.tools.gen_dashboards          # rewrite the file
    python -m shared.tools.gen_dashboards --check  # exit 1 if it is stale
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
DASHBOARD_PATH = ROOT / "deploy" / "grafana" / "dashboards" / "cleave.json"
DATASOURCE = {"type": "prometheus", "uid": "${datasource}"}
RATE = "$__rate_interval"
PREFILL = 'role="prefill",instance=~"$instance"'
DECODE = 'role="decode",instance=~"$instance"'
WORKERS = 'role=~"$pool",instance=~"$instance"'


def quantiles(metric: str, selector: str, by: str = "") -> list[tuple[str, str]]:
    """p50/p95/p99 targets of a histogram: ``[(legend, expr), ...]``."""
    group = f"le{', ' + by if by else ''}"
    suffix = f" {{{{{by}}}}}" if by else ""
    return [
        (f"p{q}{suffix}", f"histogram_quantile(0.{q}, sum by ({group}) (rate({metric}_bucket{{{selector}}}[{RATE}])))")
        for q in ("50", "95", "99")
    ]


def panel(title: str, unit: str, description: str, targets: list[tuple[str, str]], kind: str = "timeseries") -> dict:
    return {
        "type": kind,
        "title": title,
        "description": description,
        "datasource": DATASOURCE,
        "fieldConfig": {"defaults": {"unit": unit}, "overrides": []},
        "targets": [
            {"refId": chr(ord("A") + i), "expr": expr, "legendFormat": legend, "datasource": DATASOURCE}
            for i, (legend, expr) in enumerate(targets)
        ],
    }


def overview() -> list[dict]:
    return [
        panel("Requests/s", "reqps", "Finished HTTP requests per second at the router, by endpoint and status.",
              [("{{endpoint}} {{status}}", f"sum by (endpoint, status) (rate(cleave_router_requests_total[{RATE}]))")]),
        panel("Errors/s", "reqps", "HTTP requests answered with a 4xx or 5xx status, per second.",
              [("{{status}}", f'sum by (status) (rate(cleave_router_requests_total{{status=~"[45].."}}[{RATE}]))')]),
        panel("Time to first token", "s", "Request arrival at the router to its first token (TTFT).",
              quantiles("cleave_router_time_to_first_token_seconds", "")),
        panel("Inter-token latency", "s", "Gap between consecutive streamed tokens at the router (ITL).",
              quantiles("cleave_router_inter_token_latency_seconds", "")),
        panel("End-to-end latency", "s", "Request arrival at the router to its last token.",
              quantiles("cleave_router_e2e_request_latency_seconds", "")),
        panel("Tokens/s", "short", "Prompt and generated tokens of finished requests per second.",
              [("prompt", f"sum(rate(cleave_router_prompt_tokens_total[{RATE}]))"),
               ("generation", f"sum(rate(cleave_router_generation_tokens_total[{RATE}]))")]),
    ]  # fmt: skip


def prefill_pool() -> list[dict]:
    return [
        panel("Prefill queue", "short", "Requests waiting to be scheduled on each prefill worker.",
              [("{{instance}}", f"sum by (instance) (cleave_num_requests_waiting{{{PREFILL}}})")]),
        panel("Prefill throughput", "short", "Prompt tokens computed per second (prefix-cache hits excluded).",
              [("{{instance}}", f"sum by (instance) (rate(cleave_prompt_tokens_total{{{PREFILL}}}[{RATE}]))")]),
        panel("Prefix cache hit rate", "percentunit", "Prompt tokens found in the prefix cache / tokens looked up.",
              [("{{instance}}", f"sum by (instance) (rate(cleave_prefix_cache_hits_total{{{PREFILL}}}[{RATE}])) / "
                                f"sum by (instance) (rate(cleave_prefix_cache_queries_total{{{PREFILL}}}[{RATE}]))")]),
        panel("Prefill queue time", "s", "Time a request waits on a prefill worker before its first schedule.",
              quantiles("cleave_request_queue_time_seconds", PREFILL)),
        panel("Prefill time", "s", "First schedule to first token on a prefill worker.",
              quantiles("cleave_request_prefill_time_seconds", PREFILL)),
    ]  # fmt: skip


def kv_transfer() -> list[dict]:
    return [
        panel("KV bytes/s", "Bps", "KV cache bytes pulled by decode workers from prefill workers per second.",
              [("{{instance}}", f"sum by (instance) (rate(cleave_kv_transfer_bytes_total{{{DECODE}}}[{RATE}]))")]),
        panel("KV pull latency", "s", "Duration of one KV pull (p50/p95/p99).",
              quantiles("cleave_kv_transfer_seconds", DECODE)),
        panel("KV pull failures/s", "short", "KV pulls that failed, expired leases included.",
              [("{{instance}}", f"sum by (instance) (rate(cleave_kv_transfer_failures_total{{{DECODE}}}[{RATE}]))")]),
        panel("Recomputes/s", "short", "Requests whose prefill a decode worker recomputed after a failed pull.",
              [("{{instance}}", f"sum by (instance) (rate(cleave_kv_recomputes_total{{{DECODE}}}[{RATE}]))")]),
        panel("Lease expiries/s", "short", "Prefilled KV leases that expired before a decode worker released them.",
              [("{{instance}}", f"sum by (instance) (rate(cleave_kv_lease_expired_total{{{PREFILL}}}[{RATE}]))")]),
        panel("Descriptors per pull", "short", "Transfer descriptors per KV pull (contiguous blocks merge into one).",
              [("{{instance}}", f"sum by (instance) (rate(cleave_kv_transfer_descriptors_total{{{DECODE}}}[{RATE}])) / "
                                f"sum by (instance) (rate(cleave_kv_transfers_total{{{DECODE}}}[{RATE}]))")]),
        panel("Transfer backend", "none", "KV transfer backend each worker uses.",
              [("{{instance}} {{backend}}", f"cleave_kv_transfer_backend_info{{{WORKERS}}}")], kind="table"),
    ]  # fmt: skip


def decode_pool() -> list[dict]:
    return [
        panel("Running", "short", "Requests in the running batch of each decode worker.",
              [("{{instance}}", f"sum by (instance) (cleave_num_requests_running{{{DECODE}}})")]),
        panel("Waiting", "short", "Requests waiting on each decode worker.",
              [("{{instance}}", f"sum by (instance) (cleave_num_requests_waiting{{{DECODE}}})")]),
        panel("KV cache usage", "percentunit", "Fraction of KV cache blocks in use, per worker of the selected pools.",
              [("{{role}} {{instance}}", f"cleave_kv_cache_usage_perc{{{WORKERS}}}")]),
        panel("Preemptions/s", "short", "Requests preempted by recompute when KV blocks ran out.",
              [("{{instance}}", f"sum by (instance) (rate(cleave_num_preemptions_total{{{DECODE}}}[{RATE}]))")]),
        panel("Worker inter-token latency", "s", "Gap between consecutive tokens as the decode engine emits them.",
              quantiles("cleave_inter_token_latency_seconds", DECODE)),
        panel("Tokens per engine step", "short", "Tokens batched into one engine step (p50/p95/p99).",
              quantiles("cleave_iteration_tokens", WORKERS)),
    ]  # fmt: skip


def router() -> list[dict]:
    return [
        panel("Routing decisions/s", "short", "Worker picks by pool, policy and outcome (picked or no_worker).",
              [("{{role}} {{policy}} {{outcome}}", "sum by (role, policy, outcome) "
                f"(rate(cleave_router_routing_decisions_total[{RATE}]))")]),
        panel("Routed sequences/s", "short", "Choices sent disaggregated (prefill then decode) or aggregated.",
              [("{{path}}", f"sum by (path) (rate(cleave_router_routed_sequences_total[{RATE}]))")]),
        panel("Finished by reason/s", "short", "Choices that finished, by finish reason.",
              [("{{finish_reason}}", f"sum by (finish_reason) (rate(cleave_router_finished_sequences_total[{RATE}]))")]),
        panel("Worker health", "bool", "1 when the router's last health poll of a worker succeeded.",
              [("{{role}} {{address}}", "cleave_router_worker_healthy")]),
        panel("Requests in flight", "short", "HTTP generation requests the router is serving now.",
              [("in flight", "sum(cleave_router_requests_running)")]),
        *control_plane(),
    ]  # fmt: skip


def control_plane() -> list[dict]:
    """Router panels for what keeps requests flowing when workers come, go and fill up."""
    return [
        panel("Retries/s", "short", "Worker calls sent to another worker of the pool after one was unreachable.",
              [("{{role}}", f"sum by (role) (rate(cleave_router_retries_total[{RATE}]))")]),
        panel("Migrations/s", "short", "Decode streams that broke mid-generation, by outcome: migrated to another "
              "decode worker, refused (--migration-limit, n>1), or no_worker left.",
              [("{{outcome}}", f"sum by (outcome) (rate(cleave_router_migrations_total[{RATE}]))")]),
        panel("Rejected (429)/s", "reqps", "Requests refused with 429 because every worker of a pool had "
              "--max-queued-requests calls open, by pool.",
              [("{{role}}", f"sum by (role) (rate(cleave_router_rejected_requests_total[{RATE}]))")]),
        panel("Request timeouts/s", "reqps", "Requests that ran longer than --request-timeout.",
              [("timeouts", f"sum(rate(cleave_router_request_timeouts_total[{RATE}]))")]),
        panel("Pool workers", "short", "Workers in each pool, from static flags or the Redis registry.",
              [("{{role}} {{source}}", "sum by (role, source) (cleave_router_pool_workers)")]),
        panel("Redis up", "bool", "1 when the router's last Redis call succeeded (registry watch, KV events).",
              [("{{instance}} {{component}}", "cleave_router_redis_up")]),
        panel("Redis reconnects", "short", "Redis outages the router came back from, in the interval.",
              [("{{component}}", f"sum by (component) (increase(cleave_router_redis_reconnects_total[{RATE}]))")]),
        panel("KV index entries", "short", "(block hash, worker) pairs in the router's KV index (kv_aware routing).",
              [("{{instance}}", "sum by (instance) (cleave_router_kv_index_entries)")]),
        panel("KV index drops/s", "short", "KV index entries dropped, oldest first, to stay within "
              "--kv-index-max-entries.",
              [("{{instance}}", f"sum by (instance) (rate(cleave_router_kv_index_dropped_total[{RATE}]))")]),
    ]  # fmt: skip


ROWS = (
    ("Overview", overview),
    ("Prefill pool", prefill_pool),
    ("KV transfer", kv_transfer),
    ("Decode pool", decode_pool),
    ("Router", router),
)


def variable(name: str, label: str, query: str) -> dict:
    return {
        "name": name, "label": label, "type": "query", "datasource": DATASOURCE,
        "query": {"query": query, "refId": name}, "definition": query, "refresh": 2,
        "includeAll": True, "multi": True, "allValue": ".*", "current": {"text": "All", "value": "$__all"},
    }  # fmt: skip


def build_dashboard() -> dict[str, Any]:
    panels: list[dict] = []
    y = 0
    for panel_id, (title, make) in enumerate(ROWS):
        panels.append({"type": "row", "title": title, "collapsed": False, "id": 100 + panel_id,
                       "gridPos": {"h": 1, "w": 24, "x": 0, "y": y}, "panels": []})  # fmt: skip
        y += 1
        for i, p in enumerate(make()):
            p["gridPos"] = {"h": 8, "w": 8, "x": (i % 3) * 8, "y": y + (i // 3) * 8}
            panels.append(p)
        y += 8 * ((len(make()) + 2) // 3)
    for i, p in enumerate(panels):
        p.setdefault("id", i + 1)
    datasource = {"name": "datasource", "label": "Data source", "type": "datasource", "query": "prometheus",
                  "current": {"text": "Prometheus", "value": "prometheus"}}  # fmt: skip
    return {
        "uid": "cleave-overview",
        "title": "Cleave",
        "description": "A Cleave cluster: router, prefill pool, KV transfer, decode pool.",
        "tags": ["cleave", "llm-serving"],
        "timezone": "browser",
        "schemaVersion": 39,
        "version": 1,
        "refresh": "10s",
        "time": {"from": "now-30m", "to": "now"},
        "templating": {
            "list": [
                datasource,
                variable("pool", "Pool", "label_values(cleave_num_requests_running, role)"),
                variable("instance", "Instance", 'label_values(cleave_num_requests_running{role=~"$pool"}, instance)'),
            ]
        },  # fmt: skip
        "panels": panels,
    }


def render() -> str:
    return json.dumps(build_dashboard(), indent=2, sort_keys=True) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m shared.tools.gen_dashboards", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    parser.add_argument("--check", action="store_true", help="exit 1 if the checked-in dashboard is stale")
    args = parser.parse_args(argv)
    text = render()
    if args.check:
        if not DASHBOARD_PATH.exists() or DASHBOARD_PATH.read_text() != text:
            print(f"{DASHBOARD_PATH} is stale; run python -m shared.tools.gen_dashboards", file=sys.stderr)
            return 1
        return 0
    DASHBOARD_PATH.parent.mkdir(parents=True, exist_ok=True)
    DASHBOARD_PATH.write_text(text)
    print(f"wrote {DASHBOARD_PATH}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
