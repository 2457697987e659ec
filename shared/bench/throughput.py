"""``cleave bench throughput``: offline generation throughput, Cleave vs transformers and vLLM.

Backends: ``cleave`` (this engine), ``hf`` (transformers ``generate`` in static
batches: every batch runs until its longest request is done), ``hf-cb``
(transformers continuous batching) and ``vllm`` (vLLM's offline ``LLM``, run by
the Python of a separate vLLM install given by ``--vllm-python``; vLLM is never
a dependency of Cleave). EOS is ignored so every backend produces exactly the
requested tokens. Prints one JSON object; ``cleave`` and ``vllm`` also report
``output_digest``, a hash of the greedy tokens, equal when the engines agree.
``peak_memory_bytes`` is this process's peak resident size, or for ``vllm`` the
peak of its processes' summed proportional set sizes (``peak_memory_of`` says which).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from shared import flags
from shared.bench.vllm_offline import output_digest
from shared.bench.workload import BenchRequest, make_workload
from shared.cli import add_engine_args, engine_config_from_args
from shared.models.default_model import resolve_model
from shared.models.gguf_file import is_gguf_path


def _peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


class TreeMemory:
    """The peak of the summed memory of a process and its descendants, sampled every ``interval``
    seconds on a thread: vLLM runs its engine in a process of its own, so neither its front process's
    peak nor the largest child's is what the run held. Each process counts its proportional set size
    where the kernel gives it (a page shared by k of them counts 1/k in each, so the libraries every
    process maps count once), else its resident size. Reading a process's proportional set size walks its
    page tables, a large part of a core for a model's processes at 10 samples a second, taken from the
    engine it measures; so the thread samples once a second, at the lowest priority."""

    def __init__(self, pid: int, interval: float = 1.0) -> None:
        import psutil

        self._root = psutil.Process(pid)
        self._interval = interval
        self._stop = threading.Event()
        self.peak_bytes = 0
        self._thread = threading.Thread(target=self._run, name="tree-memory", daemon=True)
        self._thread.start()

    def _sample(self) -> int:
        import psutil

        total = 0
        try:
            processes = [self._root, *self._root.children(recursive=True)]
        except psutil.Error:
            return 0
        for process in processes:
            try:
                total += getattr(process.memory_full_info(), "pss", None) or process.memory_info().rss
            except psutil.Error:
                pass  # gone meanwhile
        return total

    def _run(self) -> None:
        try:
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)  # this thread only (Linux)
        except OSError:
            pass
        while not self._stop.is_set():
            self.peak_bytes = max(self.peak_bytes, self._sample())
            self._stop.wait(self._interval)

    def stop(self) -> int:
        self._stop.set()
        self._thread.join()
        return self.peak_bytes


def run_cleave(args, workload) -> dict:
    from shared.engine import LLM, SamplingParams

    config = engine_config_from_args(args)
    llm = LLM(**vars(config))
    engine = llm.engine
    utilization: list[float] = []
    step = engine.step

    def measured_step():
        # Live tokens over allocated slots, sampled every step.
        live = sum(r.num_computed_tokens for r in engine.scheduler.running)
        blocks = sum(len(b) for b in engine.kv.req_blocks.values())
        if blocks:
            utilization.append(live / (blocks * engine.config.block_size))
        return step()

    engine.step = measured_step

    def greedy(requests: list[BenchRequest]) -> list[SamplingParams]:  # token ids only, like the transformers baselines
        return [SamplingParams(temperature=0.0, max_tokens=r.max_tokens, ignore_eos=True, detokenize=False)
                for r in requests]  # fmt: skip

    params = greedy(workload)
    warmup = SamplingParams(temperature=0.0, max_tokens=2, detokenize=False)
    llm.generate([workload[0].prompt_token_ids], [warmup], use_tqdm=False)  # builds the CPU kernels once
    for round_ in warmup_workloads(args):
        llm.generate([r.prompt_token_ids for r in round_], greedy(round_), use_tqdm=False)
    utilization.clear()
    preempted_before = engine.stats().num_preemptions
    start = time.perf_counter()
    outputs = llm.generate([r.prompt_token_ids for r in workload], params, use_tqdm=args.progress)
    elapsed = time.perf_counter() - start
    token_ids = [list(o.outputs[0].token_ids) for o in outputs]
    stats = engine.stats()
    return {
        "elapsed_s": elapsed,
        "output_tokens": sum(map(len, token_ids)),
        "output_digest": output_digest(token_ids),
        "kv_slot_utilization": sum(utilization) / max(len(utilization), 1),
        "num_preemptions": stats.num_preemptions - preempted_before,
        "kv_blocks": engine.num_blocks,
    }


def bench_workloads(args, seeds: list[int]) -> list[list[BenchRequest]]:
    """The requests of one run per seed: ``--num-prompts`` random prompts below the model's vocabulary (never one
    of its special tokens), ``--prompt-len`` and ``--output-len`` long. The model's config is read once."""
    if not seeds:
        return []
    from shared.models.config import load_model_config

    model_config = load_model_config(args.model)
    specials = [*model_config.eos_token_ids, model_config.bos_token_id]
    avoid = frozenset(t for t in specials if t is not None)
    return [make_workload(args.num_prompts, tuple(args.prompt_len), tuple(args.output_len), model_config.vocab_size,
                          seed, avoid) for seed in seeds]  # fmt: skip


def warmup_workloads(args) -> list[list[BenchRequest]]:
    """``--warmup-rounds`` workloads of the timed one's shape, each of its own prompts (other seeds: nothing
    they leave in a prefix cache serves the timed run)."""
    return bench_workloads(args, [args.seed + 1000 * (i + 1) for i in range(args.warmup_rounds)])


def _load_hf(args):
    import torch
    from transformers import AutoModelForCausalLM

    dtype = torch.bfloat16 if args.dtype == "bfloat16" else torch.float32
    device = "cuda" if torch.cuda.is_available() and args.device != "cpu" else "cpu"
    path = resolve_model(args.model)
    if is_gguf_path(path):  # transformers reads GGUF from a directory plus a file name
        source = AutoModelForCausalLM.from_pretrained(os.path.dirname(os.path.abspath(path)), gguf_file=os.path.basename(path), dtype=dtype)  # fmt: skip
    else:
        source = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    model = source.to(device).eval()
    return model, device


def run_hf(args, workload) -> dict:
    """Static batches: each runs to its longest request; live/allocated slots reported as utilization."""
    import torch

    model, device = _load_hf(args)
    pad_id = 0
    num_out, live, allocated = 0, 0, 0
    start = time.perf_counter()
    for i in range(0, len(workload), args.hf_batch_size):
        batch = workload[i : i + args.hf_batch_size]
        max_prompt = max(len(r.prompt_token_ids) for r in batch)
        max_new = max(r.max_tokens for r in batch)
        ids = torch.full((len(batch), max_prompt), pad_id, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for row, r in enumerate(batch):  # left padding
            ids[row, max_prompt - len(r.prompt_token_ids) :] = torch.tensor(r.prompt_token_ids)
            mask[row, max_prompt - len(r.prompt_token_ids) :] = 1
        with torch.inference_mode():
            model.generate(
                input_ids=ids.to(device), attention_mask=mask.to(device), max_new_tokens=max_new,
                min_new_tokens=max_new, do_sample=False, pad_token_id=pad_id,
            )  # fmt: skip
        num_out += sum(r.max_tokens for r in batch)  # only the tokens each request asked for count
        live += sum(len(r.prompt_token_ids) + r.max_tokens for r in batch)
        allocated += len(batch) * (max_prompt + max_new)
    elapsed = time.perf_counter() - start
    return {"elapsed_s": elapsed, "output_tokens": num_out, "kv_slot_utilization": live / allocated}


def run_hf_cb(args, workload) -> dict:
    import torch
    from transformers import GenerationConfig

    model, device = _load_hf(args)
    config = GenerationConfig(max_new_tokens=max(r.max_tokens for r in workload), do_sample=False, eos_token_id=-1)
    start = time.perf_counter()
    with torch.inference_mode():
        with model.continuous_batching_context_manager(generation_config=config, block=True, timeout=5) as manager:
            ids = [manager.add_request(r.prompt_token_ids, max_new_tokens=r.max_tokens) for r in workload]
            pending, num_out = set(ids), 0
            while pending:
                result = manager.get_result(timeout=1)
                if result is not None and result.is_finished():
                    pending.discard(result.request_id)
                    num_out += len(result.generated_tokens)
    elapsed = time.perf_counter() - start
    return {"elapsed_s": elapsed, "output_tokens": num_out, "kv_slot_utilization": None}


def _vllm_env(args) -> dict[str, str]:
    import shared

    env = {k: v for k, v in os.environ.items() if shared.DEFAULTED_ENV.get(k) != v}  # vLLM keeps its own defaults
    cpus = sorted(os.sched_getaffinity(0))
    env.setdefault("VLLM_CPU_OMP_THREADS_BIND", f"{cpus[0]}-{cpus[-1]}" if len(cpus) > 1 else str(cpus[0]))
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", str(max(1, round(args.kv_cache_memory / 2**30))))  # GiB
    env.pop("PYTHONPATH", None)  # vLLM's own interpreter and packages only
    return env


def _spec_requests(requests: list[BenchRequest]) -> list[dict]:
    return [{"prompt_token_ids": r.prompt_token_ids, "max_tokens": r.max_tokens} for r in requests]


def run_vllm(args, workload) -> dict:
    """The same workload on vLLM, in a child process of ``--vllm-python`` (greedy, EOS ignored)."""
    from shared.config import default_step_tokens
    from shared.engine.engine_core import resolve_device
    from shared.models.config import load_model_config

    if not args.vllm_python:
        raise SystemExit("--backend vllm needs --vllm-python: the python of a separate vLLM install")
    model_config = load_model_config(args.model)
    dtype = args.dtype if args.dtype != "auto" else (model_config.torch_dtype or "float32")
    kv_cache_dtype = args.kv_cache_dtype  # vLLM's names, but float32 is its "auto" for a float32 model
    if kv_cache_dtype == "float32":
        if dtype not in ("float32", "float16"):
            raise SystemExit("--backend vllm: vLLM keeps a float32 KV cache for a float32 model only (--dtype float32)")
        kv_cache_dtype = "auto"
    spec = {
        "model": str(Path(args.model).resolve()), "dtype": "float32" if dtype == "float16" else dtype,
        # The budget Cleave's engine picks when --max-num-batched-tokens is 0: vLLM gets the same.
        "max_num_batched_tokens": args.max_num_batched_tokens
        or default_step_tokens(resolve_device(args.device).type, model_config.layer_parameters),
        "max_num_seqs": args.max_num_seqs,
        "enable_prefix_caching": not args.no_prefix_caching,
        "max_model_len": int(args.max_model_len) if args.max_model_len else None,
        "kv_cache_dtype": kv_cache_dtype,
        "requests": _spec_requests(workload),
        "warmup_rounds": [_spec_requests(round_) for round_ in warmup_workloads(args)],
    }  # fmt: skip
    with tempfile.NamedTemporaryFile("w", suffix=".json") as f:
        json.dump(spec, f)
        f.flush()
        script = Path(__file__).with_name("vllm_offline.py")
        proc = subprocess.Popen([args.vllm_python, str(script), f.name], env=_vllm_env(args),
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)  # fmt: skip
        memory = TreeMemory(proc.pid)
        try:
            stdout, stderr = proc.communicate(timeout=args.vllm_timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.communicate()
            raise SystemExit(f"vLLM run took longer than --vllm-timeout {args.vllm_timeout:g} s") from None
        finally:
            peak = memory.stop()
    lines = [line for line in stdout.splitlines() if line.startswith("CLEAVE_BENCH_RESULT ")]
    if proc.returncode != 0 or not lines:
        raise SystemExit(f"vLLM run failed (exit {proc.returncode}):\n{stderr[-3000:]}")
    result = json.loads(lines[-1].removeprefix("CLEAVE_BENCH_RESULT "))
    return result | {
        "kv_slot_utilization": None,
        "peak_memory_bytes": peak,
        "peak_memory_of": "vLLM's processes (proportional set size)",
    }


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="cleave bench throughput", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    add_engine_args(parser)
    parser.add_argument("--backend", choices=["cleave", "hf", "hf-cb", "vllm"], default="cleave")
    parser.add_argument("--num-prompts", type=int, default=200)
    parser.add_argument("--prompt-len", type=int, nargs=2, default=(32, 512), metavar=("MIN", "MAX"))
    parser.add_argument("--output-len", type=int, nargs=2, default=(16, 256), metavar=("MIN", "MAX"))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--warmup-rounds", type=int, default=0,
                        help="cleave and vllm backends: run this many workloads of the same shape (other prompts) "
                        "untimed first, so that the timed run finds every kernel built for its shapes (vLLM's "
                        "CPU build compiles kernels per new batch shape; a server has them after its first bursts)")  # fmt: skip
    parser.add_argument("--hf-batch-size", type=int, default=32, help="static batch size of the hf backend")
    parser.add_argument("--progress", action="store_true", help="show a progress bar (cleave backend)")
    parser.add_argument(
        "--vllm-python", help="vllm backend: the python of a separate vLLM install, e.g. /opt/vllm/bin/python"
    )
    parser.add_argument("--vllm-timeout", type=float, default=1800.0,
                        help="vllm backend: seconds to allow (its first start compiles the model)")  # fmt: skip
    args = flags.parse_args(parser, argv)

    if args.warmup_rounds < 0:
        raise SystemExit("--warmup-rounds: a count, 0 or more")
    if args.warmup_rounds and args.backend not in ("cleave", "vllm"):
        raise SystemExit("--warmup-rounds: the cleave and vllm backends only")
    (workload,) = bench_workloads(args, [args.seed])
    runner = {"cleave": run_cleave, "hf": run_hf, "hf-cb": run_hf_cb, "vllm": run_vllm}[args.backend]
    result = runner(args, workload)
    elapsed = result.pop("elapsed_s")
    prompt_tokens = sum(len(r.prompt_token_ids) for r in workload)
    report = {
        "backend": args.backend,
        "model": args.model,
        "num_requests": len(workload),
        "elapsed_s": round(elapsed, 3),
        "requests_per_s": round(len(workload) / elapsed, 3),
        "output_tokens_per_s": round(result["output_tokens"] / elapsed, 2),
        "total_tokens_per_s": round((result["output_tokens"] + prompt_tokens) / elapsed, 2),
        "peak_memory_bytes": _peak_rss_bytes(),
        "peak_memory_of": "this process",
        **result,
    }
    json.dump(report, sys.stdout, indent=2)
    print()
    return 0
