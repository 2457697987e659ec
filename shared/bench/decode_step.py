"""``python -m shared.bench.decode_step``: decode step time against the memory roofline,
against the model's linear layers alone, and against those plus the decode attention.

For each batch size, fills the engine with that many requests of
``--context-len`` prompt tokens, lets them reach decode, then times
``--steps`` pure-decode steps. The roofline is the time to read the weights
plus the live KV cache once at the measured copy bandwidth (a device-to-device
copy of ``--copy-bytes``, counted as read + write). The linear bound is the time
the step's matrix products alone take at the same shapes (every projection of
every layer on ``[batch, hidden]`` rows, plus the LM head), timed in the same
run: ``step_over_linear`` is how much the rest of the step adds. On the CPU the
attention bound adds every layer's paged decode kernel over the same requests' KV
cache (``attention_ms``): ``step_over_linear_and_attention`` is what the step adds
to the two kinds of kernel it cannot do without (norms, RoPE, the KV write,
sampling, the engine's Python). Prints JSON.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time

import torch

from shared import flags
from shared.cli import add_engine_args, engine_config_from_args, parse_bytes
from shared.engine.engine_core import EngineCore
from shared.engine.model_runner import kv_block_bytes
from shared.engine.sampling_params import SamplingParams
from shared.kernels import cpu_kernels


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def copy_bandwidth(device: torch.device, num_bytes: int, repeats: int = 5) -> float:
    """Bytes moved per second (read + write) by a plain tensor copy."""
    src = torch.empty(num_bytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    _sync(device)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        dst.copy_(src)
        _sync(device)
        best = min(best, time.perf_counter() - t0)
    return 2 * num_bytes / best


@torch.inference_mode()
def linear_bound_ms(model, batch: int, steps: int) -> float:
    """Milliseconds per step of the model's linear layers alone on ``batch`` decode rows, on the kernel
    the model's own forward uses for them (the native projection on the CPU where it runs)."""
    projections = []  # (the module or function the model calls, its weight), in forward order
    for layer in model.decoder_layers():
        attn, mlp = layer.self_attn, layer.mlp
        projections += [(p, p.weight) for p in (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)]
    projections.append((model.compute_logits, model.output_weight))
    weights = [w for _, w in projections]
    inputs = [torch.randn(batch, cpu_kernels.projection_shape(w)[1], device=w.device,
                          dtype=torch.float32 if cpu_kernels.held_shape(w) is not None else w.dtype)
              for w in weights]  # fmt: skip

    def run() -> None:
        for x, (project, _) in zip(inputs, projections, strict=True):
            project(x)

    run()
    _sync(weights[0].device)
    t0 = time.perf_counter()
    for _ in range(steps):
        run()
    _sync(weights[0].device)
    return (time.perf_counter() - t0) / steps * 1000


@torch.inference_mode()
def attention_bound_ms(core: EngineCore, steps: int) -> float | None:
    """Milliseconds per step of the decode attention alone: every layer's paged decode kernel over the running
    requests' own block tables and context lengths (one new token each), on the engine's KV cache. None where
    the CPU kernel does not run (another device, or a cache it declines)."""

    kv, config, running = core.runner.kv_cache, core.model_config, core.scheduler.running
    query = torch.randn(len(running), config.num_heads, config.head_dim)
    if kv.device.type != "cpu" or not running or not cpu_kernels.supports(query, kv[:, 0, 0], kv[:, 0, 1]):
        return None
    block_size = kv.shape[3]
    tables = [core.scheduler.kv.block_ids(r.request_id) for r in running]
    seq_lens = [min(r.num_computed_tokens + 1, len(t) * block_size) for r, t in zip(running, tables, strict=True)]
    width = max(len(t) for t in tables)
    block_tables = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
    scale = config.head_dim**-0.5

    def run() -> bool:
        return all(
            cpu_kernels.paged_decode(query, kv[:, layer, 0], kv[:, layer, 1], block_tables, seq_lens, scale) is not None
            for layer in range(config.num_layers)
        )

    if not run():
        return None
    # In a step the weights pass through the caches between one layer's attention and the next: read as much
    # before each timed run (untimed), so that a cache that fits in the last-level cache is not timed from there.
    floats = min(sum(p.numel() for p in core.model.parameters()), 64 << 20)  # at most 256 MiB
    flush = torch.ones(floats, dtype=torch.float32)
    total = 0.0
    for _ in range(steps):
        flush.sum()
        t0 = time.perf_counter()
        run()
        total += time.perf_counter() - t0
    return total / steps * 1000


def measure(core: EngineCore, batch: int, context_len: int, steps: int, seed: int) -> dict:
    rng = random.Random(seed)
    vocab = core.model_config.vocab_size
    ids = [f"bench-{batch}-{i}" for i in range(batch)]
    # The first requests decode while the later ones prefill: they must not finish before the timed steps.
    prefill_steps = -(-batch * context_len // core.max_num_batched_tokens) + batch
    max_tokens = min(steps + 8 + prefill_steps, core.max_model_len - context_len)
    for rid in ids:
        prompt = [rng.randrange(vocab) for _ in range(context_len)]
        core.add_request(rid, prompt, SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True))
    while core.scheduler.waiting or any(r.num_computed_tokens < r.num_prompt_tokens for r in core.scheduler.running):
        core.step()
    for _ in range(2):  # warm up the pure-decode path
        core.step()
    _sync(core.device)
    decoding = len(core.scheduler.running)
    t0 = time.perf_counter()
    for _ in range(steps):
        core.step()
    _sync(core.device)
    step_s = (time.perf_counter() - t0) / steps
    if decoding != batch or len(core.scheduler.running) != batch:
        raise SystemExit(f"batch {batch}: {decoding} requests decoding, not {batch} (KV cache too small?)")
    live_tokens = sum(r.num_tokens for r in core.scheduler.running) - batch * steps // 2  # mid-run average
    attention_ms = attention_bound_ms(core, steps)
    for rid in ids:
        core.abort(rid)
    return {"batch": batch, "step_ms": step_s * 1000, "live_tokens": live_tokens, "attention_ms": attention_ms}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m shared.bench.decode_step", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    add_engine_args(parser)
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[64, 256])
    parser.add_argument("--context-len", type=int, default=512)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--copy-bytes", type=parse_bytes, default=None, help="default: 1GiB on CUDA, 256MiB on CPU")
    parser.add_argument("--seed", type=int, default=0)
    args = flags.parse_args(parser, argv)
    config = engine_config_from_args(args)
    core = EngineCore(config)
    device = core.device
    copy_bytes = args.copy_bytes or (1 << 30 if device.type == "cuda" else 256 << 20)
    bandwidth = copy_bandwidth(device, copy_bytes)
    weight_bytes = sum(p.numel() * p.element_size() for p in core.model.parameters())
    kv_per_token = kv_block_bytes(core.model_config, config.block_size, core.runner.kv_cache.dtype) // config.block_size
    results = []
    for batch in args.batch_sizes:
        r = measure(core, batch, args.context_len, args.steps, args.seed)
        kv_bytes = r["live_tokens"] * kv_per_token
        roofline_ms = 1000 * (weight_bytes + kv_bytes) / bandwidth
        linear_ms = linear_bound_ms(core.model, batch, args.steps)
        result = {**r, "kv_bytes": kv_bytes, "roofline_ms": roofline_ms, "step_over_roofline": r["step_ms"] / roofline_ms,
                  "linear_ms": linear_ms, "step_over_linear": r["step_ms"] / linear_ms}  # fmt: skip
        if r["attention_ms"] is not None:
            kernels_ms = linear_ms + r["attention_ms"]
            result |= {
                "linear_and_attention_ms": kernels_ms,
                "step_over_linear_and_attention": r["step_ms"] / kernels_ms,
            }
        results.append(result)
    report = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "dtype": core.dtype_name, "attention_backend": core.runner.attn_backend.name,
        "cuda_graphs": core.runner.graphs is not None, "copy_bandwidth_bytes_per_s": bandwidth,
        "weight_bytes": weight_bytes, "context_len": args.context_len, "results": results,
    }  # fmt: skip
    json.dump(report, sys.stdout, indent=2)
    print()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
