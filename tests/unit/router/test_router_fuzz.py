"""Runs the schemathesis fuzz of ``fuzz_router.py`` in a fresh interpreter (see there why)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]


@pytest.mark.slow
def test_fuzzing_the_published_schema_finds_no_5xx_and_no_violation():
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-s", "-p", "no:cacheprovider", str(Path(__file__).with_name("fuzz_router.py"))],
        capture_output=True, text=True, cwd=ROOT, env=env, timeout=300,
    )  # fmt: skip
    counts = re.findall(r"fuzz mode=\w+ statuses=\{[^}]*\}", run.stdout)
    print("\n".join(counts))
    assert run.returncode == 0, run.stdout[-6000:] + run.stderr[-2000:]
    assert len(counts) == 2
