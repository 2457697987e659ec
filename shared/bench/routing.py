"""``python -m shared.bench.routing``: the shared-prefix workload under each routing policy.

For every run it starts a fresh cluster the way a fleet runs: a local
``redis-server``, ``--prefill-workers`` + ``--decode-workers`` workers registered
in it (``--redis-url``) and a router that only discovers them
(``--redis-url --routing-policy P``). Once the router sees every worker healthy,
``cleave bench serve`` loads it with ``--worker-metrics`` pointing at every
worker, and the cluster stops. Fresh processes per run: no policy inherits
another's warm caches or counters.

Policies run interleaved for ``--rounds`` rounds (a, b, c, a, b, c, ...), so
that a shared machine's background load falls on all of them alike. Prints one
JSON line per run (policy, round, prefix hit rate against the ideal, TTFT
mean/p50/p99, output tokens/s, KV bytes pulled per request) and, last, one line per
policy with the medians over its rounds. Flags after ``--`` go to
``cleave bench serve`` (``--prefix-groups 8 --prefix-len 1024 --num-prompts 120
--request-rate 1 ...``); unknown flags before it go to every worker (engine
flags such as ``--kv-cache-memory``); ``--router-arg`` to the router.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import threading
import time
import urllib.request
from dataclasses import dataclass, field

from shared.bench.observability import drain_output, stop_cluster

POLICIES = ("kv_aware", "least_loaded", "round_robin")
# The report's columns: (row key, bench serve key).
COLUMNS = (
    ("prefix_hit_rate", "prefix_hit_rate"),
    ("ideal_prefix_hit_rate", "ideal_prefix_hit_rate"),
    ("hit_rate_vs_ideal", "prefix_hit_rate_vs_ideal"),
    ("ttft_mean_ms", "mean_ttft_ms"),
    ("ttft_p50_ms", "median_ttft_ms"),
    ("ttft_p99_ms", "p99_ttft_ms"),
    ("output_tok_s", "output_throughput"),
    ("kv_bytes_per_request", "kv_transfer_bytes_per_request"),
    ("completed", "completed"),
    ("failed", "failed"),
)


def parse_args(argv: list[str]) -> tuple[argparse.Namespace, list[str], list[str]]:
    """This script's flags, the workers' extra flags (unknown ones) and ``cleave bench serve``'s (after ``--``)."""
    if "--" in argv:
        cut = argv.index("--")
        argv, bench_args = argv[:cut], argv[cut + 1 :]
    else:
        bench_args = []
    parser = argparse.ArgumentParser(prog="python -m shared.bench.routing", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    parser.add_argument("--model", required=True, help="checkpoint directory every process serves")
    parser.add_argument("--policies", nargs="+", default=list(POLICIES), choices=POLICIES)
    parser.add_argument("--rounds", type=int, default=2, help="runs per policy, interleaved")
    parser.add_argument("--prefill-workers", type=int, default=2)
    parser.add_argument("--decode-workers", type=int, default=2)
    parser.add_argument("--router-arg", action="append", default=[],
                        help="one more router flag (repeatable), e.g. --router-arg=--kv-overlap-weight=2")  # fmt: skip
    args, worker_args = parser.parse_known_args(argv)
    if args.rounds < 1:
        parser.error("--rounds must be >= 1")
    if args.decode_workers < 1 or args.prefill_workers < 0:
        parser.error("--decode-workers must be >= 1 and --prefill-workers >= 0")
    return args, worker_args, bench_args


def run_order(policies: list[str], rounds: int) -> list[tuple[int, str]]:
    """(round, policy) in the order the runs happen: every policy once per round."""
    return [(r, p) for r in range(1, rounds + 1) for p in policies]


def report_row(policy: str, round_no: int, report: dict) -> dict:
    """One run's line: the columns of the routing table, from a ``cleave bench serve`` report."""
    row: dict = {"policy": policy, "round": round_no}
    for key, source in COLUMNS:
        row[key] = report.get(source)
    return row


def policy_medians(rows: list[dict]) -> list[dict]:
    """Per policy (in first-seen order), the median of each numeric column over its rounds."""
    out = []
    for policy in dict.fromkeys(r["policy"] for r in rows):
        mine = [r for r in rows if r["policy"] == policy]
        summary: dict = {"policy": policy, "rounds": len(mine)}
        for key, _ in COLUMNS:
            values = [r[key] for r in mine if isinstance(r.get(key), (int, float))]
            summary[key] = round(statistics.median(values), 3) if values else None
        out.append(summary)
    return out


@dataclass
class Cluster:
    """Redis, workers and a router, each its own process group (so that stopping reaches their children)."""

    procs: list[subprocess.Popen] = field(default_factory=list)
    metrics_urls: list[str] = field(default_factory=list)
    base_url: str = ""

    def spawn(self, cmd: list[str], ready: str | None = None) -> tuple[subprocess.Popen, dict[str, str]]:
        """Start ``cmd``; with ``ready``, wait for the line starting with it and return its key=value fields."""
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        env.setdefault("OMP_NUM_THREADS", "1")
        out = subprocess.PIPE if ready else subprocess.DEVNULL
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, text=True, env=env,
                                start_new_session=True)  # fmt: skip
        self.procs.append(proc)
        if ready is None:
            return proc, {}
        assert proc.stdout is not None
        tail: list[str] = []
        for line in proc.stdout:
            tail = [*tail[-30:], line]
            if line.startswith(ready):
                threading.Thread(target=drain_output, args=(proc,), daemon=True).start()
                return proc, dict(p.split("=", 1) for p in line.split()[1:] if "=" in p)
        raise RuntimeError(f"{cmd[2]} exited with code {proc.wait()}:\n{''.join(tail)}")

    def stop(self) -> None:
        for proc in reversed(self.procs):  # router first, Redis last (stopping workers deregister)
            if proc.poll() is None:
                stop_cluster(proc)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_cluster(args: argparse.Namespace, policy: str, worker_args: list[str]) -> Cluster:
    cluster = Cluster()
    redis_port = _free_port()
    cluster.spawn(["redis-server", "--port", str(redis_port), "--bind", "127.0.0.1", "--save", "",
                   "--appendonly", "no"])  # fmt: skip
    redis_url = f"redis://127.0.0.1:{redis_port}/0"
    _wait(lambda: _connects(redis_port), 30, "redis-server")
    common = ["--model", args.model, "--port", "0", "--metrics-port", "0", "--redis-url", redis_url, *worker_args]
    roles = ["prefill"] * args.prefill_workers + ["decode"] * args.decode_workers
    for role in roles:
        _, info = cluster.spawn([sys.executable, "-m", f"services.{role}_worker", *common], ready="CLEAVE_READY")
        cluster.metrics_urls.append(f"http://127.0.0.1:{info['metrics_port']}/metrics")
    port = _free_port()
    cluster.spawn([sys.executable, "-m", "services.router", "--model", args.model, "--port", str(port),
                   "--redis-url", redis_url, "--routing-policy", policy, *args.router_arg])  # fmt: skip
    cluster.base_url = f"http://127.0.0.1:{port}"
    _wait(lambda: _all_healthy(cluster.base_url, args.prefill_workers, args.decode_workers), 120, "router")
    return cluster


def _connects(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


def _all_healthy(base_url: str, num_prefill: int, num_decode: int) -> bool:
    """Whether the router has discovered every worker and found each healthy."""
    try:
        with urllib.request.urlopen(base_url + "/health", timeout=2) as resp:
            body = json.loads(resp.read())
    except OSError:
        return False
    healthy = {role: sum(w["healthy"] for w in body.get(role, [])) for role in ("prefill", "decode")}
    return healthy == {"prefill": num_prefill, "decode": num_decode}


def _wait(ready, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not ready():
        if time.monotonic() > deadline:
            raise RuntimeError(f"{what} not ready after {timeout_s:.0f} s")
        time.sleep(0.2)


def main(argv: list[str] | None = None) -> int:
    from shared.bench.observability import bench_serve

    args, worker_args, bench_args = parse_args(list(sys.argv[1:] if argv is None else argv))
    rows = []
    for round_no, policy in run_order(args.policies, args.rounds):
        cluster = start_cluster(args, policy, worker_args)
        try:
            metrics = [a for url in cluster.metrics_urls for a in ("--worker-metrics", url)]
            report = bench_serve(["--base-url", cluster.base_url, *metrics, *bench_args])
        finally:
            cluster.stop()
        rows.append(report_row(policy, round_no, report))
        print(json.dumps(rows[-1]), flush=True)
    for summary in policy_medians(rows):
        print(json.dumps({"median": True, **summary}), flush=True)
    return 0 if all(r["failed"] == 0 for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
