"""``cleave bench fork --http``: forks and beam search through the HTTP server, same run.

Starts one aggregated decode worker (prefix caching off, so independent
requests pay for their own prompt blocks) and a router on free ports, then
serves the same token-id prompts four ways, one mode after the other, every
prompt's requests concurrent:

- ``fork``: ``n`` samples as one request (the engine forks after one prefill);
- ``independent``: ``n`` single-sample requests with seeds ``seed + i``;
- ``beam``: beam search of width ``n``, the ``n`` beams returned;
- ``greedy``: ``n`` independent greedy requests.

Reports, per mode, the peak KV blocks in use on the worker (polled through
``LoadStats``) and output tokens/s, as JSON.
"""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from typing import Any

import grpc
import httpx

from shared.genproto.cleave.v1 import worker_pb2, worker_pb2_grpc
from shared.launcher import ensure_model, wait_http_ok
from shared.supervisor import Supervisor

MODES = ("fork", "independent", "beam", "greedy")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def bodies(mode: str, prompt: list[int], n: int, max_tokens: int, seed: int) -> list[dict[str, Any]]:
    """The completion requests one prompt costs in ``mode``."""
    base: dict[str, Any] = {"prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True}
    if mode == "fork":
        return [{**base, "n": n, "temperature": 0.8, "seed": seed}]
    if mode == "independent":
        return [{**base, "temperature": 0.8, "seed": seed + i} for i in range(n)]
    if mode == "beam":
        return [{**base, "n": n, "use_beam_search": True}]
    return [{**base, "temperature": 0.0} for _ in range(n)]


class PeakBlocks:
    """Polls a worker's ``LoadStats`` in a thread: the most KV blocks in use while it runs."""

    def __init__(self, grpc_addr: str) -> None:
        self._channel = grpc.insecure_channel(grpc_addr)
        self._stub = worker_pb2_grpc.DecodeWorkerStub(self._channel)
        self.peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)

    def _poll(self) -> None:
        while not self._stop.is_set():
            stats = self._stub.LoadStats(worker_pb2.LoadStatsRequest(), timeout=10)
            self.peak = max(self.peak, stats.num_total_blocks - stats.num_free_blocks)
            self._stop.wait(0.005)

    def __enter__(self) -> PeakBlocks:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self._channel.close()


async def run_mode(base_url: str, model: str, requests: list[dict[str, Any]]) -> tuple[int, float]:
    """Send every request at once; output tokens and seconds."""
    async with httpx.AsyncClient(base_url=base_url, timeout=600) as client:

        async def one(body: dict[str, Any]) -> int:
            response = await client.post("/v1/completions", json={"model": model, **body})
            response.raise_for_status()
            return int(response.json()["usage"]["completion_tokens"])

        t0 = time.perf_counter()
        counts = await asyncio.gather(*(one(b) for b in requests))
        return sum(counts), time.perf_counter() - t0


def run_http(args: Any, prompts: list[list[int]], engine_args: list[str]) -> dict[str, Any]:
    """Start the worker and router, run every mode, stop them; the per-mode figures."""
    model = ensure_model(args.model)
    cluster = Supervisor()
    try:
        quiet = ["--log-level", "WARNING"]  # the JSON report owns stdout
        worker = cluster.start(
            "decode", "services.decode_worker", ["--model", model, "--port", "0", *quiet, *engine_args]
        )
        info = cluster.wait_ready_line(worker)
        port = _free_port()
        router = cluster.start(
            "router",
            "services.router",
            ["--model", model, "--port", str(port), "--served-model-name", "bench", "--decode-worker", info["grpc"],
             *quiet],
        )  # fmt: skip
        cluster.drain(router)
        base_url = f"http://127.0.0.1:{port}"
        wait_http_ok(base_url + "/health", router.proc)
        results: dict[str, Any] = {}
        warm = bodies("beam", prompts[0], args.n, 4, args.seed) + bodies("fork", prompts[0], args.n, 4, args.seed)
        asyncio.run(run_mode(base_url, "bench", warm))
        for mode in MODES:
            requests = [
                b for i, p in enumerate(prompts) for b in bodies(mode, p, args.n, args.max_tokens, args.seed + i)
            ]
            with PeakBlocks(info["grpc"]) as peak:
                num_tokens, seconds = asyncio.run(run_mode(base_url, "bench", requests))
            results[mode] = {
                "peak_blocks": peak.peak,
                "output_tokens": num_tokens,
                "output_tokens_per_s": round(num_tokens / seconds, 1),
            }
        return results
    finally:
        cluster.stop()
