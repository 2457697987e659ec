"""Runs one offline throughput workload on vLLM; started by ``cleave bench throughput --backend vllm``.

It runs under the Python of a separate vLLM install (``--vllm-python``), so it
imports only the standard library and vLLM, never Cleave. Usage::

    VLLM_PYTHON shared/bench/vllm_offline.py SPEC.json

SPEC holds the engine settings and the requests (token-id prompts, output
lengths). Prints one JSON line: elapsed seconds, output tokens, and the digest
of the greedy tokens (the same digest Cleave's backend reports).
"""

from __future__ import annotations

import hashlib
import json
import sys
import time


def output_digest(token_ids: list[list[int]]) -> str:
    """sha256 over the requests' output token ids, in request order."""
    return hashlib.sha256(json.dumps(token_ids).encode()).hexdigest()[:16]


def main(spec_path: str) -> int:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    spec = json.loads(open(spec_path, encoding="utf-8").read())
    llm = LLM(
        model=spec["model"], dtype=spec["dtype"], max_num_batched_tokens=spec["max_num_batched_tokens"],
        max_num_seqs=spec["max_num_seqs"], enable_prefix_caching=spec["enable_prefix_caching"],
        max_model_len=spec["max_model_len"], kv_cache_dtype=spec.get("kv_cache_dtype", "auto"),
        skip_tokenizer_init=True, seed=0,
    )  # fmt: skip

    def inputs(requests: list[dict]) -> tuple[list, list]:  # greedy, EOS ignored
        return ([TokensPrompt(prompt_token_ids=r["prompt_token_ids"]) for r in requests],
                [SamplingParams(temperature=0.0, max_tokens=r["max_tokens"], ignore_eos=True, detokenize=False)
                 for r in requests])  # fmt: skip

    prompts, params = inputs(spec["requests"])
    llm.generate(prompts[:1], [SamplingParams(temperature=0.0, max_tokens=2, detokenize=False)], use_tqdm=False)
    for round_ in spec.get("warmup_rounds", []):  # untimed, other prompts (cleave bench throughput --warmup-rounds)
        llm.generate(*inputs(round_), use_tqdm=False)
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    token_ids = [list(o.outputs[0].token_ids) for o in outputs]
    result = {
        "elapsed_s": elapsed,
        "output_tokens": sum(map(len, token_ids)),
        "output_digest": output_digest(token_ids),
    }
    print("CLEAVE_BENCH_RESULT " + json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":  # vLLM spawns worker processes that re-import this module
    raise SystemExit(main(sys.argv[1]))
