"""``python -m shared.bench.fork``: ``n`` samples as one engine fork vs ``n`` independent requests.

Both runs use the same engine settings, prompts and sampling (seeded, EOS
ignored), one after the other; prefix caching is off so that independent
requests pay for their own prompt blocks, as they would on different workers
or once the cache is cold. Reports peak KV blocks in use and output tokens/s
per mode. This is the engine the decode worker runs for ``n > 1`` over HTTP.
The same run also compares beam search of width ``n`` (the ``n`` beams
returned) with ``n`` independent greedy requests. With ``--http`` every mode
goes through a router and a decode worker started for the run
(``shared.bench.fork_http``). Prints JSON.
"""

from __future__ import annotations

import argparse
import json
import random
import time

from shared.cli import add_engine_args, engine_config_from_args
from shared.engine.engine_core import EngineCore
from shared.engine.sampling_params import SamplingParams


def run(core: EngineCore, prompts: list[list[int]], params: SamplingParams, fork: bool) -> dict[str, float]:
    """Serve every prompt with ``params.n`` samples (or beams); peak blocks in use and output tokens/s."""
    pool = core.kv.pool
    start_free = pool.num_free_blocks
    for p_index, prompt in enumerate(prompts):
        if fork:
            core.add_request(f"fork-{p_index}", prompt, params)
            continue
        for i in range(params.n):
            seed = None if params.seed is None else params.seed + i
            single = SamplingParams(**{**params.__dict__, "n": 1, "seed": seed})
            core.add_request(f"single-{p_index}-{i}", prompt, single)
    peak, num_tokens = 0, 0
    t0 = time.perf_counter()
    while core.has_unfinished():
        num_tokens += sum(len(delta.new_token_ids) for delta in core.step())
        peak = max(peak, start_free - pool.num_free_blocks)
    seconds = time.perf_counter() - t0
    return {"peak_blocks": peak, "output_tokens": num_tokens, "output_tokens_per_s": round(num_tokens / seconds, 1)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="cleave bench fork", description=__doc__)
    add_engine_args(parser)
    parser.add_argument("--n", type=int, default=4, help="samples per prompt")
    parser.add_argument("--num-prompts", type=int, default=8)
    parser.add_argument("--prompt-len", type=int, default=256)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--http", action="store_true", help="through a router and a decode worker started for the run")
    args = parser.parse_args(argv)
    args.no_prefix_caching = True
    if args.http:
        from shared.bench.fork_http import run_http

        prompts = _prompts(args, _vocab_size(args.model))
        results = run_http(args, prompts, _worker_args(args))
    else:
        results = _run_engine(args)
    ratios = {
        "independent_over_fork_blocks": _ratio(results["independent"], results["fork"]),
        "greedy_over_beam_blocks": _ratio(results["greedy"], results["beam"]),
    }
    print(json.dumps({"path": "http" if args.http else "engine", "n": args.n, "num_prompts": args.num_prompts,
                      "prompt_len": args.prompt_len, "max_tokens": args.max_tokens, **results, **ratios},
                     indent=2))  # fmt: skip
    return 0


def _run_engine(args: argparse.Namespace) -> dict[str, dict[str, float]]:
    core = EngineCore(engine_config_from_args(args))
    prompts = _prompts(args, core.model_config.vocab_size)
    common = {"max_tokens": args.max_tokens, "ignore_eos": True}
    sampled = SamplingParams(n=args.n, temperature=0.8, seed=args.seed, **common)
    beam = SamplingParams(n=args.n, use_beam_search=True, **common)
    greedy = SamplingParams(n=args.n, temperature=0.0, **common)
    run(core, prompts[:1], sampled, fork=True)  # warm-up
    run(core, prompts[:1], beam, fork=True)
    return {
        "fork": run(core, prompts, sampled, fork=True),
        "independent": run(core, prompts, sampled, fork=False),
        "beam": run(core, prompts, beam, fork=True),
        "greedy": run(core, prompts, greedy, fork=False),
    }


def _prompts(args: argparse.Namespace, vocab_size: int) -> list[list[int]]:
    rng = random.Random(args.seed)
    return [[rng.randrange(3, vocab_size) for _ in range(args.prompt_len)] for _ in range(args.num_prompts)]


def _vocab_size(model: str) -> int:
    from shared.launcher import ensure_model
    from shared.models.config import load_model_config

    return load_model_config(ensure_model(model)).vocab_size


def _worker_args(args: argparse.Namespace) -> list[str]:
    """The engine flags of this run, for the decode worker."""
    flags = ["--dtype", args.dtype, "--kv-cache-dtype", args.kv_cache_dtype, "--device", args.device, "--block-size", str(args.block_size),
             "--kv-cache-memory", str(args.kv_cache_memory), "--max-num-seqs", str(args.max_num_seqs),
             "--max-num-batched-tokens", str(args.max_num_batched_tokens), "--no-prefix-caching"]  # fmt: skip
    return flags + (["--enforce-eager"] if args.enforce_eager else [])


def _ratio(independent: dict[str, float], shared: dict[str, float]) -> float:
    return round(independent["peak_blocks"] / max(1, shared["peak_blocks"]), 2)


if __name__ == "__main__":
    raise SystemExit(main())
