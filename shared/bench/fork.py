"""``python -m shared.bench.fork``: ``n`` samples as one engine fork vs ``n`` independent requests.

Both runs use the same engine settings, prompts and sampling (seeded, EOS
ignored), one after the other; prefix caching is off so that independent
requests pay for their own prompt blocks, as they would on different workers
or once the cache is cold. Reports peak KV blocks in use and output tokens/s
per mode. This is the engine the decode worker runs for ``n > 1`` over HTTP;
prints JSON.
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
    """Serve every prompt with ``params.n`` samples; peak blocks in use and output tokens/s."""
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
        num_tokens += len(core.step())
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
    args = parser.parse_args(argv)
    args.no_prefix_caching = True
    core = EngineCore(engine_config_from_args(args))
    rng = random.Random(args.seed)
    vocab = core.model_config.vocab_size
    prompts = [[rng.randrange(3, vocab) for _ in range(args.prompt_len)] for _ in range(args.num_prompts)]
    params = SamplingParams(n=args.n, temperature=0.8, seed=args.seed, max_tokens=args.max_tokens, ignore_eos=True)
    run(core, prompts[:1], params, fork=True)  # warm-up
    results = {mode: run(core, prompts, params, fork=mode == "fork") for mode in ("fork", "independent")}
    block_ratio = results["independent"]["peak_blocks"] / max(1, results["fork"]["peak_blocks"])
    print(json.dumps({"n": args.n, "num_prompts": args.num_prompts, "prompt_len": args.prompt_len,
                      "max_tokens": args.max_tokens, **results, "independent_over_fork_blocks": round(block_ratio, 2)},
                     indent=2))  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
