"""Loading a model stays cheap: no torch._dynamo (sympy, triton) behind parameter initialisation."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from tests.helpers.checkpoints import make_checkpoint

ROOT = Path(__file__).resolve().parents[3]


def test_loading_a_checkpoint_imports_no_dynamo(tmp_path):
    path = make_checkpoint(tmp_path / "ckpt", "llama")
    code = (
        "import sys, json\n"
        "from shared.models.loader import load_model\n"
        f"model, _ = load_model({str(path)!r}, 'float32', 'cpu')\n"
        "print(json.dumps({'dynamo': 'torch._dynamo' in sys.modules}))\n"
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120, check=True)
    assert json.loads(out.stdout.strip().splitlines()[-1]) == {"dynamo": False}
