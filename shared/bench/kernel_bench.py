"""Paged decode attention kernel benchmark (CUDA only); prints JSON.

``python -m shared.bench.kernel_bench`` times one layer's Triton decode call for
a Llama-3.2-1B KV geometry (16 layers, 8 KV heads, 32 query heads, head_dim 64,
16-token blocks, bf16) at batch 64 and 256 with 640-token contexts. It reports
time per call and the bandwidth achieved on the KV bytes the call must read,
next to the device's copy bandwidth (a 1 GiB ``torch`` copy, read + write).
"""

from __future__ import annotations

import argparse
import json
import sys

import torch

from shared.kernels.metadata import AttentionMetadata

NUM_LAYERS, NUM_KV_HEADS, NUM_HEADS, HEAD_DIM, BLOCK_SIZE = 16, 8, 32, 64, 16


def _time_us(fn, iters: int) -> float:
    """Mean microseconds per call of ``fn`` over ``iters`` back-to-back calls."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / iters


def copy_bandwidth_gbps(num_bytes: int = 1 << 30, iters: int = 20) -> float:
    src = torch.empty(num_bytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    dst.copy_(src)
    return 2 * num_bytes / (_time_us(lambda: dst.copy_(src), iters) * 1e3)  # read + write, GB/s


def _decode_inputs(batch: int, context: int, dtype: torch.dtype, seed: int = 0):
    """A full-geometry paged cache with scattered blocks and one decode step's metadata."""
    gen = torch.Generator().manual_seed(seed)
    blocks_per_seq = -(-context // BLOCK_SIZE)
    num_blocks = batch * blocks_per_seq + 1
    block_ids = torch.randperm(num_blocks, generator=gen)[: batch * blocks_per_seq]
    block_tables = block_ids.view(batch, blocks_per_seq).to(torch.int32).cuda()  # [batch, blocks_per_seq]
    # [num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim]
    kv_cache = torch.randn(num_blocks, NUM_LAYERS, 2, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM, dtype=dtype, device="cuda")
    last = block_tables[:, (context - 1) // BLOCK_SIZE].long() * BLOCK_SIZE + (context - 1) % BLOCK_SIZE
    meta = AttentionMetadata(
        slot_mapping=last,
        query_start_loc=torch.arange(batch + 1, dtype=torch.int32, device="cuda"),
        seq_lens=torch.full((batch,), context, dtype=torch.int32, device="cuda"),
        block_tables=block_tables,
        max_query_len=1,
        max_seq_len=context,
        block_size=BLOCK_SIZE,
        query_lens_cpu=[1] * batch,
        seq_lens_cpu=[context] * batch,
    )
    query = torch.randn(batch, NUM_HEADS, HEAD_DIM, dtype=dtype, device="cuda")  # [batch, num_heads, head_dim]
    return kv_cache, query, meta


def bench_decode(batch: int, context: int, iters: int, layer: int = NUM_LAYERS // 2) -> dict:
    from shared.kernels import triton_attention

    dtype = torch.bfloat16
    kv_cache, query, meta = _decode_inputs(batch, context, dtype)
    k_cache, v_cache = kv_cache[:, layer, 0], kv_cache[:, layer, 1]
    backend = triton_attention.TritonAttentionBackend()

    def call() -> torch.Tensor:
        return backend.forward(query, k_cache, v_cache, meta, HEAD_DIM**-0.5)

    for _ in range(3):  # compile and warm up
        call()
    eager_us = _time_us(call, iters)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        call()
    graph_us = _time_us(graph.replay, iters)
    kv_bytes = batch * context * NUM_KV_HEADS * HEAD_DIM * 2 * kv_cache.element_size()  # K and V of one layer
    num_splits = triton_attention.choose_num_splits(
        batch,
        NUM_KV_HEADS,
        context,
        triton_attention.DEFAULT_PARTITION_SIZE,
        torch.cuda.get_device_properties(0).multi_processor_count,
    )
    del kv_cache, graph
    torch.cuda.empty_cache()
    return {
        "batch": batch,
        "context": context,
        "num_splits": num_splits,
        "time_us_graph": round(graph_us, 2),
        "time_us_eager": round(eager_us, 2),
        "kv_bytes": kv_bytes,
        "kv_bandwidth_gbps": round(kv_bytes / (graph_us * 1e3), 1),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[64, 256])
    parser.add_argument("--context", type=int, default=640)
    parser.add_argument("--iters", type=int, default=200)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("kernel_bench needs a CUDA device (the Triton kernels do not run natively on CPU)", file=sys.stderr)
        return 2
    copy_gbps = copy_bandwidth_gbps()
    results = [bench_decode(batch, args.context, args.iters) for batch in args.batch_sizes]
    for result in results:
        result["fraction_of_copy_bandwidth"] = round(result["kv_bandwidth_gbps"] / copy_gbps, 3)
    geometry: dict[str, object] = {"num_layers": NUM_LAYERS, "num_kv_heads": NUM_KV_HEADS, "num_heads": NUM_HEADS}
    geometry |= {"head_dim": HEAD_DIM, "block_size": BLOCK_SIZE, "dtype": "bfloat16"}
    report = {
        "benchmark": "paged_decode_attention",
        "device": torch.cuda.get_device_name(0),
        "geometry": geometry,
        "copy_bandwidth_gbps": round(copy_gbps, 1),
        "results": results,
    }
    print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
