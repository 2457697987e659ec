"""``cleave bench fork`` on a tiny checkpoint: every mode runs and sharing shows in the block counts."""

from __future__ import annotations

import json

import pytest

from shared.bench.fork import main


@pytest.mark.slow  # four engine runs
def test_bench_fork_engine_reports_fewer_blocks_for_fork_and_beam(checkpoint_factory, capsys):
    model_dir = checkpoint_factory("llama")
    argv = ["--model", str(model_dir), "--device", "cpu", "--dtype", "float32", "--block-size", "4", "--kv-cache-memory", "8MiB",
            "--num-prompts", "2", "--prompt-len", "24", "--max-tokens", "4", "--n", "3"]  # fmt: skip
    assert main(argv) == 0
    report = json.loads(capsys.readouterr().out)
    for mode in ("fork", "independent", "beam", "greedy"):
        assert report[mode]["output_tokens"] == 2 * 3 * 4
    assert report["fork"]["peak_blocks"] < report["independent"]["peak_blocks"]
    assert report["beam"]["peak_blocks"] < report["greedy"]["peak_blocks"]
