"""The ``cleave`` command line: offline generation and the throughput benchmark's three backends."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.integration.cluster import ROOT


def cleave(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "-m", "shared.cli", *args], capture_output=True, text=True, cwd=ROOT,
                          env=env, timeout=timeout)  # fmt: skip


def test_generate_prints_the_offline_completion(checkpoint_factory):
    from shared.engine import LLM, SamplingParams

    model_dir = str(checkpoint_factory("llama"))
    done = cleave("generate", "--model", model_dir, "--prompt", "the weather", "--max-tokens", "6", "--dtype", "float32",
                  "--kv-cache-memory", "16MiB", "--ignore-eos")  # fmt: skip
    assert done.returncode == 0, done.stderr
    llm = LLM(model=model_dir, dtype="float32", num_blocks=64)
    expected = llm.generate(["the weather"], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
    assert done.stdout == expected[0].outputs[0].text + "\n"


def test_generate_reports_bad_input():
    done = cleave("generate", "--model", "/nonexistent-model", "--prompt", "hi")
    assert done.returncode == 2 and "model directory not found" in done.stderr


@pytest.mark.parametrize("backend", ["cleave", "hf", "hf-cb"])
def test_throughput_benchmark_prints_json(checkpoint_factory, backend):
    model_dir = str(checkpoint_factory("llama"))
    done = cleave("bench", "throughput", "--model", model_dir, "--backend", backend, "--num-prompts", "6",
                  "--prompt-len", "8", "24", "--output-len", "4", "12", "--dtype", "float32",
                  "--kv-cache-memory", "16MiB")  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    report = json.loads(done.stdout)
    assert report["backend"] == backend and report["num_requests"] == 6
    assert report["output_tokens_per_s"] > 0 and report["peak_memory_bytes"] > 0
    # Every backend produces exactly the requested tokens, EOS ignored.
    assert report["output_tokens"] == expected_output_tokens(model_dir)
    if backend != "hf-cb":
        assert 0 < report["kv_slot_utilization"] <= 1


def expected_output_tokens(model_dir: str) -> int:
    """What the benchmark's default workload (seed 0) asks for, recomputed independently."""
    from shared.bench.workload import make_workload
    from shared.models.config import load_model_config

    cfg = load_model_config(model_dir)
    avoid = frozenset(t for t in [*cfg.eos_token_ids, cfg.bos_token_id] if t is not None)
    workload = make_workload(6, (8, 24), (4, 12), cfg.vocab_size, 0, avoid)
    return sum(r.max_tokens for r in workload)
