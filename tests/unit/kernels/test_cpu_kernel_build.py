"""Building and loading the native CPU kernels leaves the process's floating-point mode alone."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]


@pytest.mark.skipif(shutil.which("cc") is None and shutil.which("gcc") is None, reason="no C compiler")
def test_loading_the_kernels_keeps_subnormal_floats(tmp_path) -> None:
    # -ffast-math at link time would pull in crtfastmath.o, which sets flush-to-zero for
    # every thread of the process as soon as the library loads.
    probe = (
        "import torch; from shared.kernels import cpu_kernels;"
        "tiny = torch.tensor([1e-39]); assert (tiny * 1.0).item() != 0.0;"
        "assert cpu_kernels.load() is not None, 'the kernels did not build';"
        "print((tiny * 1.0).item())"
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT), "CLEAVE_CACHE_DIR": str(tmp_path), "OMP_NUM_THREADS": "1"}
    env.pop("CLEAVE_CPU_KERNELS", None)
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr
    assert float(done.stdout.strip()) != 0.0, "loading the kernels turned on flush-to-zero"
