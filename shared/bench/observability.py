"""``cleave bench observability``: what tracing and metrics scraping cost.

Starts ``cleave serve`` once per mode and runs the same ``cleave bench serve``
workload against it:

- ``off``: tracing off, nobody scrapes /metrics;
- ``tracing``: every process exports every span (100% sampling) over OTLP/gRPC
  to a local receiver in this process, which counts them;
- ``scrape``: tracing off, every /metrics endpoint scraped once a second.

Modes run in turn for ``--rounds`` rounds; the JSON has each run's output
throughput, each mode's median, and the overhead of each mode against ``off``
in percent. Flags after ``--`` go to ``cleave bench serve`` (e.g.
``-- --num-prompts 100 --request-rate 8``); unknown flags go to ``cleave serve``
(engine flags such as ``--kv-cache-memory``).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import threading
import urllib.request
from concurrent import futures

MODES = ("off", "tracing", "scrape")


class SpanSink:
    """An OTLP/gRPC trace receiver that only counts spans."""

    def __init__(self) -> None:
        import grpc
        from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc

        sink = self

        class Servicer(trace_service_pb2_grpc.TraceServiceServicer):
            def Export(self, request, context):
                count = sum(len(ss.spans) for rs in request.resource_spans for ss in rs.scope_spans)
                with sink.lock:
                    sink.num_spans += count
                return trace_service_pb2.ExportTraceServiceResponse()

        self.lock = threading.Lock()
        self.num_spans = 0
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(Servicer(), self.server)
        self.endpoint = f"http://127.0.0.1:{self.server.add_insecure_port('127.0.0.1:0')}"
        self.server.start()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_cluster(serve_args: list[str], port: int) -> tuple[subprocess.Popen, list[str]]:
    """``cleave serve`` on ``port``; returns it once serving, with every /metrics URL it printed."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "shared.cli", "serve", "--port", str(port), *serve_args],
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, start_new_session=True,
    )  # fmt: skip
    assert proc.stdout is not None
    urls = []
    for line in proc.stdout:
        urls += [p.split("=", 1)[1] for p in line.split() if p.startswith("metrics=http")]
        if "router metrics:" in line:
            urls.append(line.split()[-1])
        if "Press Ctrl-C" in line:
            threading.Thread(target=drain_output, args=(proc,), daemon=True).start()
            return proc, urls
    raise RuntimeError(f"cleave serve exited with code {proc.wait()} before serving")


def drain_output(proc: subprocess.Popen) -> None:
    """Read a child's stdout to the end, so its pipe never fills and blocks it."""
    assert proc.stdout is not None
    for _ in proc.stdout:
        pass


def stop_cluster(proc: subprocess.Popen) -> None:
    os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def bench_serve(argv: list[str]) -> dict:
    from shared.bench.serve import main as serve_main

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        serve_main(argv)
    return json.loads(out.getvalue())


def scrape_every_second(urls: list[str], stop: threading.Event) -> None:
    while not stop.wait(1.0):
        for url in urls:
            with contextlib.suppress(OSError), urllib.request.urlopen(url, timeout=5) as resp:
                resp.read()


def run_mode(mode: str, serve_args: list[str], bench_args: list[str], sink: SpanSink) -> dict:
    port = _free_port()
    extra = ["--otlp-traces-endpoint", sink.endpoint] if mode == "tracing" else []
    proc, urls = start_cluster([*serve_args, *extra], port)
    stop = threading.Event()
    try:
        base = f"http://127.0.0.1:{port}"
        bench_serve(["--base-url", base, "--num-prompts", "8", "--seed", "1"])  # warm-up
        spans_before = sink.num_spans
        scraper = threading.Thread(target=scrape_every_second, args=(urls, stop), daemon=True)
        if mode == "scrape":
            scraper.start()
        report = bench_serve(["--base-url", base, *bench_args])
    finally:
        stop.set()
        stop_cluster(proc)  # flushes the spans still queued
    return {"mode": mode, "output_throughput": report["output_throughput"], "completed": report["completed"],
            "failed": report["failed"], "median_ttft_ms": report["median_ttft_ms"],
            "median_itl_ms": report["median_itl_ms"], "spans_exported": sink.num_spans - spans_before}  # fmt: skip


def main(argv: list[str]) -> int:
    if "--" in argv:
        index = argv.index("--")
        argv, bench_args = argv[:index], argv[index + 1 :]
    else:
        bench_args = ["--num-prompts", "64", "--prompt-len", "32", "128", "--output-len", "16", "64",
                      "--long-prompt-fraction", "0"]  # fmt: skip
    parser = argparse.ArgumentParser(prog="cleave bench observability", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    parser.add_argument("--rounds", type=int, default=2, help="rounds of all modes, in turn")
    parser.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    args, serve_args = parser.parse_known_args(argv)
    sink = SpanSink()
    runs = []
    for _ in range(args.rounds):
        for mode in args.modes:
            runs.append(run_mode(mode, serve_args, bench_args, sink))
            print(json.dumps(runs[-1]), file=sys.stderr, flush=True)
    medians = {m: statistics.median(r["output_throughput"] for r in runs if r["mode"] == m) for m in args.modes}
    report: dict = {"runs": runs, "median_output_throughput": medians}
    if "off" in medians:
        report["overhead_percent"] = {
            m: round(100 * (medians["off"] - v) / medians["off"], 2) for m, v in medians.items() if m != "off"
        }
    json.dump(report, sys.stdout, indent=2)
    print()
    sink.server.stop(grace=1)
    return 0 if all(r["failed"] == 0 for r in runs) else 1
