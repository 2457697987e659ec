"""``python -m shared.bench.decode_step`` on a tiny checkpoint: the step against its linear layers and
against those plus the decode attention, all measured in the same run."""

from __future__ import annotations

import json

import pytest

from shared.bench import decode_step
from shared.kernels import cpu_kernels


def test_decode_step_reports_the_linear_and_attention_bounds(checkpoint_factory, capsys):
    if cpu_kernels.load() is None:
        pytest.skip("the CPU kernels did not build here: no attention bound to report")
    model_dir = checkpoint_factory("llama")
    argv = ["--model", str(model_dir), "--batch-sizes", "1", "3", "--context-len", "40", "--steps", "3",
            "--copy-bytes", "1MiB", "--max-model-len", "128"]  # fmt: skip
    assert decode_step.main(argv) == 0
    report = json.loads(capsys.readouterr().out)
    assert [r["batch"] for r in report["results"]] == [1, 3]
    for r in report["results"]:
        assert r["step_ms"] > 0 and r["linear_ms"] > 0 and r["attention_ms"] > 0
        assert r["linear_and_attention_ms"] == pytest.approx(r["linear_ms"] + r["attention_ms"])
        assert r["step_over_linear_and_attention"] == pytest.approx(r["step_ms"] / r["linear_and_attention_ms"])
        assert r["step_over_linear"] == pytest.approx(r["step_ms"] / r["linear_ms"])
