"""Decode steps padded to a graph batch size give the same tokens as unpadded ones.

CUDA graph capture needs a GPU (tests/gpu); the padding, the skipped KV
writes of padded rows and the fixed ``max_seq_len`` are the same code on CPU,
run eagerly through the Triton kernels in the interpreter.
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from shared.engine import LLM, SamplingParams  # noqa: E402
from shared.engine.cuda_graphs import DecodeGraphs  # noqa: E402


def test_padded_decode_matches_eager(checkpoint_factory):
    pytest.importorskip("triton")
    model_dir = checkpoint_factory("llama")
    prompts = [list(range(3, 3 + n)) for n in (5, 17, 9)]
    params = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
    kwargs = dict(dtype="float32", num_blocks=32, block_size=4, attention_backend="triton", max_num_seqs=8)
    plain = LLM(model=str(model_dir), **kwargs)
    expected = [o.outputs[0].token_ids for o in plain.generate(prompts, params)]

    padded = LLM(model=str(model_dir), **kwargs)
    runner = padded.engine.runner
    graphs = DecodeGraphs(runner.model, runner.kv_cache, runner.attn_backend, 4, padded.engine.max_model_len, 8,
                          batch_sizes=(4, 8))  # fmt: skip
    graphs.enabled = True
    calls = []
    original = graphs.run

    def counting_run(*args):
        calls.append(args[2].num_seqs)
        return original(*args)

    graphs.run = counting_run
    runner.graphs = graphs
    got = [o.outputs[0].token_ids for o in padded.generate(prompts, params)]
    assert got == expected
    assert calls and all(n == 3 for n in calls)  # 3 sequences padded to a batch of 4
    assert graphs.padded_batch(3) == 4 and graphs.padded_batch(5) == 8 and graphs.padded_batch(9) is None
