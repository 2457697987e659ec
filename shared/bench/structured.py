"""``cleave bench structured``: what structured output costs, in one run of the engine.

1. Output tokens/s of a batch where half the requests carry a JSON schema vs the
   same batch unconstrained (alternating rounds, the best round of each kept).
   The schema (one string of at least 100000 characters) never completes within
   the run, so both batches generate the same number of tokens.
2. Time to first token of a request whose schema is new (compiled on arrival)
   vs one whose schema is cached.
Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

from shared.cli import add_engine_args, engine_config_from_args

LONG_SCHEMA = {"type": "object", "properties": {"text": {"type": "string", "minLength": 100000}}, "required": ["text"]}


def ttft_schema(index: int) -> dict:
    """A realistic schema; ``index`` changes a property name so each one is new to the cache."""
    return {
        "type": "object",
        "properties": {
            f"id_{index}": {"type": "integer", "minimum": 0, "maximum": 100000},
            "user": {"type": "object", "properties": {"name": {"type": "string", "maxLength": 32},
                                                      "email": {"type": "string", "pattern": "^[a-z]+@[a-z]+\\.com$"}},
                     "required": ["name", "email"]},
            "tags": {"type": "array", "items": {"enum": ["red", "green", "blue", "black"]}, "maxItems": 8},
            "score": {"type": "number", "minimum": 0, "maximum": 1},
            "status": {"enum": ["open", "closed", "pending"]},
        },
        "required": [f"id_{index}", "user", "status"],
    }  # fmt: skip


def _batch_tokens_per_s(llm, prompts, constrained_every: int | None, max_tokens: int) -> tuple[float, int]:
    """(output tokens/s, output tokens) of one batch; every ``constrained_every``-th request constrained."""
    from shared.engine import SamplingParams
    from shared.structured.constraint import Constraint

    constraint = Constraint.json_schema(LONG_SCHEMA)
    params = [
        SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, detokenize=False,
                       constraint=constraint if constrained_every and i % constrained_every == 0 else None)
        for i in range(len(prompts))
    ]  # fmt: skip
    start = time.perf_counter()
    outputs = llm.generate(prompts, params)
    elapsed = time.perf_counter() - start
    num_tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    return num_tokens / elapsed, num_tokens


def _first_token_s(llm, constraint) -> float:
    from shared.engine import SamplingParams

    start = time.perf_counter()
    llm.generate([[1, 2, 3, 4]], SamplingParams(temperature=0.0, max_tokens=1, constraint=constraint))
    return time.perf_counter() - start


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="cleave bench structured", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    add_engine_args(parser)
    parser.add_argument("--batch-size", type=int, default=32, help="requests per batch (half constrained)")
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=3, help="alternating rounds of each batch")
    parser.add_argument("--ttft-trials", type=int, default=5)
    args = parser.parse_args(argv)

    from shared.engine import LLM
    from shared.structured.constraint import Constraint

    llm = LLM(**vars(engine_config_from_args(args)))
    vocab = llm.engine.model_config.vocab_size
    prompts = [[(17 * i + 31 * j) % (vocab - 10) + 5 for j in range(args.prompt_len)] for i in range(args.batch_size)]
    _batch_tokens_per_s(llm, prompts[:4], 2, 8)  # warm-up: kernels, grammar backend, the long schema
    plain, mixed = [], []
    for _ in range(args.rounds):
        plain.append(_batch_tokens_per_s(llm, prompts, None, args.output_len))
        mixed.append(_batch_tokens_per_s(llm, prompts, 2, args.output_len))
    (best_plain, plain_tokens), (best_mixed, mixed_tokens) = max(plain), max(mixed)
    new_s, cached_s = [], []
    for trial in range(args.ttft_trials):
        constraint = Constraint.json_schema(ttft_schema(trial))
        new_s.append(_first_token_s(llm, constraint))
        cached_s.append(_first_token_s(llm, constraint))
    report = {
        "model": args.model,
        "device": str(llm.engine.device),
        "batch_size": args.batch_size,
        "output_len": args.output_len,
        "unconstrained_output_tokens_per_s": round(best_plain, 1),
        "half_constrained_output_tokens_per_s": round(best_mixed, 1),
        "constrained_overhead_pct": round(100 * (1 - best_mixed / best_plain), 2),
        "output_tokens_per_batch": {"unconstrained": plain_tokens, "half_constrained": mixed_tokens},
        "ttft_new_schema_ms": round(1000 * statistics.median(new_s), 2),
        "ttft_cached_schema_ms": round(1000 * statistics.median(cached_s), 2),
    }
    json.dump(report, sys.stdout, indent=2)
    print()
    return 0
