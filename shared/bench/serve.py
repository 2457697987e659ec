"""``cleave bench serve``: load an OpenAI-compatible server and report latencies.

Requests arrive as a Poisson process (``--request-rate``, ``inf`` for one
burst), each a streamed ``/v1/completions`` call with token-id prompts from the
throughput workload (optionally mixed with long prompts) or, with
``--prefix-groups``, a shared-prefix workload (many users per group prefix),
EOS ignored. Prints
JSON in the conventions of vLLM's serving benchmark (ms; mean/median/p99 of
TTFT, TPOT, ITL and end-to-end latency; TTFT and ITL are timed by the chunks
that carry a choice, with or without text). With ``--worker-metrics URL``
(repeatable), KV transfer bytes and seconds per request are read from the
workers' Prometheus endpoints before and after the run, and for the
shared-prefix workload the fleet's prefix-cache hit rate against the ideal
(every group's prefix computed once). Prompt tokens the server answered from
its prefix cache (``prefix_cache_hit_tokens``) are read from its own
``/metrics`` (vLLM's) or the workers'; for independent prompts any hit is
warned of, as it means a seed repeated against a warm server.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import time
import urllib.request
from dataclasses import dataclass, field

from shared.bench.workload import BenchRequest, ideal_prefix_hit_blocks, make_prefix_workload, make_workload


@dataclass
class Result:
    ok: bool = False
    ttft: float = 0.0
    e2el: float = 0.0
    itls: list[float] = field(default_factory=list)
    output_tokens: int = 0
    prompt_tokens: int = 0
    error: str = ""


async def one_request(
    client, url: str, model: str, req: BenchRequest, prompt: str | list[int], ignore_eos: bool
) -> Result:
    body = {
        "model": model, "prompt": prompt, "max_tokens": req.max_tokens, "temperature": 0.0,
        "stream": True, "stream_options": {"include_usage": True},
    }  # fmt: skip
    if ignore_eos:
        body["ignore_eos"] = True
    result = Result(prompt_tokens=len(req.prompt_token_ids))
    num_chunks = 0
    start = time.perf_counter()
    last = start
    try:
        async with client.post(url, json=body) as resp:
            if resp.status != 200:
                result.error = f"HTTP {resp.status}: {(await resp.read())[:200]!r}"
                return result
            pending = b""
            # Whatever the socket has, split into lines here: reading line by line, or through an HTTP client
            # that parses more per chunk, cost this process two to three times the CPU, which the server it
            # measures shares (on a small machine the client's work is the server's loss).
            async for data in resp.content.iter_any():
                *lines, pending = (pending + data).split(b"\n")
                for line in lines:
                    if not line.startswith(b"data: ") or line.startswith(b"data: [DONE]"):
                        continue
                    chunk = json.loads(line[6:])
                    if chunk.get("usage"):
                        result.output_tokens = chunk["usage"]["completion_tokens"]
                    # As vLLM's client: every chunk with a choice counts, text or not (a server that holds
                    # back a token's text still sends its chunk), so TTFT and ITL follow tokens.
                    if chunk.get("choices"):
                        num_chunks += 1
                        now = time.perf_counter()
                        if result.ttft == 0.0:
                            result.ttft = now - start
                        else:
                            result.itls.append(now - last)
                        last = now
        result.e2el = time.perf_counter() - start
        # Servers that send no usage: count streamed chunks as tokens.
        result.output_tokens = result.output_tokens or num_chunks
        result.ok = True
    except Exception as e:  # a failed request is counted, not fatal
        result.error = repr(e)
    return result


_COUNTERS = {"cleave_kv_transfer_bytes_total": "bytes", "cleave_kv_transfer_seconds_sum": "seconds",
             "cleave_kv_transfers_total": "transfers",
             # Prompt tokens answered from a prefix cache: Cleave's workers, and vLLM's server.
             "cleave_prefix_cache_hits_total": "prefix_hits",
             "vllm:prefix_cache_hits_total": "prefix_hits"}  # fmt: skip


def _fetch(url: str) -> str:
    with urllib.request.urlopen(url, timeout=5) as resp:
        return resp.read().decode()


def _counters(texts: list[str]) -> dict[str, float]:
    """The _COUNTERS summed over Prometheus exposition texts."""
    totals = dict.fromkeys(_COUNTERS.values(), 0.0)
    for text in texts:
        for line in text.splitlines():
            name = line.split("{", 1)[0].split(" ", 1)[0]
            if name in _COUNTERS:
                totals[_COUNTERS[name]] += float(line.rsplit(" ", 1)[1])
    return totals


def _scrape(urls: list[str]) -> dict[str, float]:
    return _counters([_fetch(url) for url in urls])


def _server_hits(base_url: str) -> float | None:
    """Prefix-cache hits (tokens) on the server's own /metrics, or None where it exports none."""
    try:
        text = _fetch(base_url + "/metrics")
    except Exception:  # a server without /metrics (or not in Prometheus' format) is measured all the same
        return None
    return _counters([text])["prefix_hits"] if "prefix_cache_hits_total" in text else None


def _run_loop(main):
    """``asyncio.run`` on uvloop where it is installed (about a quarter less of the client's CPU in a burst)."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(main)
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        return runner.run(main)


def _summary(values: list[float], prefix: str) -> dict[str, float]:
    ms = sorted(v * 1000 for v in values) or [0.0]
    p99 = ms[min(len(ms) - 1, int(round(0.99 * (len(ms) - 1))))]
    return {f"mean_{prefix}_ms": statistics.fmean(ms), f"median_{prefix}_ms": statistics.median(ms),
            f"p99_{prefix}_ms": p99}  # fmt: skip


async def run(args, workload: list[BenchRequest]) -> dict:
    import aiohttp

    timeout = aiohttp.ClientTimeout(total=None, connect=600.0, sock_read=600.0)
    connector = aiohttp.TCPConnector(limit=args.max_concurrency or 1000)
    # trust_env: the proxy variables apply as they did through httpx (NO_PROXY for a local server).
    async with aiohttp.ClientSession(timeout=timeout, connector=connector, trust_env=True) as client:
        if args.model:
            model = args.model
        else:
            async with client.get(args.base_url + "/v1/models") as resp:
                model = (await resp.json())["data"][0]["id"]
        url = args.base_url + "/v1/completions"
        rng = random.Random(args.seed)
        semaphore = asyncio.Semaphore(args.max_concurrency or len(workload))

        prompts: list[str | list[int]] = [r.prompt_token_ids for r in workload]
        if args.tokenizer:
            from shared.tokenizer import Tokenizer

            tokenizer = Tokenizer.from_dir(args.tokenizer)
            prompts = [tokenizer.decode(r.prompt_token_ids) for r in workload]

        async def limited(req, prompt):
            async with semaphore:
                return await one_request(client, url, model, req, prompt, not args.no_ignore_eos)

        start = time.perf_counter()
        tasks = []
        for req, prompt in zip(workload, prompts, strict=True):
            tasks.append(asyncio.create_task(limited(req, prompt)))
            if args.request_rate != float("inf"):
                await asyncio.sleep(rng.expovariate(args.request_rate))
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
    ok = [r for r in results if r.ok]
    out_tokens = sum(r.output_tokens for r in ok)
    tpots = [(r.e2el - r.ttft) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1]
    report = {
        "completed": len(ok), "failed": len(results) - len(ok), "duration_s": duration,
        "total_input_tokens": sum(r.prompt_tokens for r in ok), "total_output_tokens": out_tokens,
        "request_throughput": len(ok) / duration, "output_throughput": out_tokens / duration,
        "total_token_throughput": (out_tokens + sum(r.prompt_tokens for r in ok)) / duration,
        **_summary([r.ttft for r in ok], "ttft"), **_summary(tpots, "tpot"),
        **_summary([x for r in ok for x in r.itls], "itl"), **_summary([r.e2el for r in ok], "e2el"),
        # The gap after the first token: a disaggregated server's hand-off from prefill to decode.
        **_summary([r.itls[0] for r in ok if r.itls], "first_itl"),
    }  # fmt: skip
    errors = [r.error for r in results if not r.ok]
    if errors:
        report["first_error"] = errors[0]
    return report


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="cleave bench serve", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    parser.add_argument("--base-url", default="http://127.0.0.1:8000")
    parser.add_argument("--model", default=None, help="model name (default: the first of /v1/models)")
    parser.add_argument("--num-prompts", type=int, default=200)
    parser.add_argument("--request-rate", type=float, default=float("inf"), help="requests/s (Poisson); inf = burst")
    parser.add_argument("--max-concurrency", type=int, default=0, help="cap on requests in flight (0: none)")
    parser.add_argument("--prompt-len", type=int, nargs=2, default=(32, 512), metavar=("MIN", "MAX"))
    parser.add_argument("--output-len", type=int, nargs=2, default=(16, 256), metavar=("MIN", "MAX"))
    parser.add_argument(
        "--long-prompt-fraction", type=float, default=0.1, help="share of prompts from --long-prompt-len"
    )
    parser.add_argument("--long-prompt-len", type=int, nargs=2, default=(1024, 2048), metavar=("MIN", "MAX"))
    parser.add_argument("--vocab-size", type=int, default=4000, help="token ids are drawn below this")
    parser.add_argument("--avoid-token", type=int, action="append", default=[], help="token id never to put in prompts")
    parser.add_argument("--seed", type=int, default=0,
                        help="workload seed; a server with a prefix cache answers a seed it has seen from that cache, "
                        "so give each run against one server its own seed (hits are reported and warned of)")  # fmt: skip
    parser.add_argument("--worker-metrics", action="append", default=[], help="a worker's /metrics URL (repeatable)")
    parser.add_argument("--label", default="", help="free text copied into the JSON")
    parser.add_argument("--prefix-groups", type=int, default=0,
                        help="shared-prefix workload: this many groups, each request one group's prefix plus its "
                        "own suffix of --prompt-len tokens (0: independent prompts)")  # fmt: skip
    parser.add_argument("--prefix-len", type=int, default=1024, help="tokens in each group's shared prefix")
    parser.add_argument("--block-size", type=int, default=16, help="the workers' KV block size (for hit rates)")
    parser.add_argument("--no-ignore-eos", action="store_true",
                        help="do not send vLLM's ignore_eos field (for servers that refuse it)")  # fmt: skip
    parser.add_argument("--tokenizer", default=None,
                        help="send prompts as text decoded with this model directory's tokenizer (for servers that "
                        "take no token-id prompts); default: token ids")  # fmt: skip
    args = parser.parse_args(argv)
    ideal_hits = 0
    if args.prefix_groups > 0:
        workload, groups = make_prefix_workload(args.num_prompts, args.prefix_groups, args.prefix_len,
                                                tuple(args.prompt_len), tuple(args.output_len), args.vocab_size,
                                                args.seed, frozenset(args.avoid_token))  # fmt: skip
        ideal_hits = ideal_prefix_hit_blocks(workload, groups, args.prefix_len, args.block_size)
    else:
        workload = make_workload(args.num_prompts, tuple(args.prompt_len), tuple(args.output_len), args.vocab_size,
                                 args.seed, frozenset(args.avoid_token), args.long_prompt_fraction,
                                 tuple(args.long_prompt_len))  # fmt: skip
    before = _scrape(args.worker_metrics)
    server_before = _server_hits(args.base_url)
    report = _run_loop(run(args, workload))
    after = None
    if args.worker_metrics:
        time.sleep(1.5)  # workers export their counters about once a second
        after = _scrape(args.worker_metrics)
    # Hits the run got from the caches, counted where they are exported: the server's own /metrics (vLLM's),
    # else the workers'. Independent prompts never share a block, so a hit there means a repeated seed against
    # a warm server: the run then measures the server's prefix cache, not its prefill.
    server_after = _server_hits(args.base_url) if server_before is not None else None
    hit_tokens = None
    if server_before is not None and server_after is not None:
        hit_tokens = server_after - server_before
    elif after is not None:
        hit_tokens = after["prefix_hits"] - before["prefix_hits"]
    report["prefix_cache_hit_tokens"] = hit_tokens
    if hit_tokens and args.prefix_groups == 0:
        print(f"cleave bench serve: the server answered {hit_tokens:.0f} of {report['total_input_tokens']} prompt "
              "tokens from its prefix cache (these prompts share nothing: was this --seed run against it before?); "
              "the figures measure its cache, not its prefill", file=sys.stderr)  # fmt: skip
    if after is not None:
        if args.prefix_groups > 0:
            # Hit rate over the prompt blocks a prefix cache could ever serve (full blocks before the last token).
            total_blocks = sum((len(r.prompt_token_ids) - 1) // args.block_size for r in workload)
            hits = (after["prefix_hits"] - before["prefix_hits"]) / args.block_size  # the counters count tokens
            report["prefix_hit_rate"] = hits / max(total_blocks, 1)
            report["ideal_prefix_hit_rate"] = ideal_hits / max(total_blocks, 1)
            report["prefix_hit_rate_vs_ideal"] = hits / max(ideal_hits, 1)
        n = max(report["completed"], 1)
        report["kv_transfer_bytes_per_request"] = (after["bytes"] - before["bytes"]) / n
        report["kv_transfer_ms_per_request"] = 1000 * (after["seconds"] - before["seconds"]) / n
        report["kv_transfers"] = after["transfers"] - before["transfers"]
    report = {"label": args.label, "base_url": args.base_url, "request_rate": args.request_rate,
              "num_prompts": args.num_prompts, **{k: round(v, 3) if isinstance(v, float) else v
                                                  for k, v in report.items()}}  # fmt: skip
    json.dump(report, sys.stdout, indent=2)
    print()
    return 0 if report["failed"] == 0 else 1
