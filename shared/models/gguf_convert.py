"""``cleave convert-gguf FILE DIR``: a GGUF file as an ordinary Hugging Face directory (torch-free).

The directory holds ``config.json``, ``generation_config.json``, a float32
``model.safetensors`` (the dequantised weights, in Hugging Face layout),
``tokenizer.json`` and ``tokenizer_config.json`` with the chat template. It is
written next to its destination and renamed into place, so a reader never sees
half a checkpoint.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

from shared.models.config import ModelLoadError
from shared.models.gguf_file import GGUFCheckpoint
from shared.models.gguf_tokenizer import write_tokenizer


def convert_gguf(gguf_path: str | Path, out_dir: str | Path) -> Path:
    """Write the Hugging Face directory for ``gguf_path`` at ``out_dir`` (which must not exist or be empty)."""
    from safetensors.numpy import save_file

    out_dir = Path(out_dir)
    if out_dir.exists() and (not out_dir.is_dir() or any(out_dir.iterdir())):
        raise ModelLoadError(f"{out_dir}: already exists and is not an empty directory; choose a new one")
    checkpoint = GGUFCheckpoint(gguf_path)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", dir=out_dir.parent))
    os.chmod(staging, 0o755)  # mkdtemp makes it private; a checkpoint is meant to be shared
    try:
        write_tokenizer(checkpoint, staging)
        _write_json(staging / "config.json", checkpoint.hf_config())
        _write_json(staging / "generation_config.json", checkpoint.hf_generation_config())
        tensors = dict(checkpoint.hf_tensors())
        save_file(tensors, str(staging / "model.safetensors"), metadata={"format": "pt", "source": checkpoint.path.name})  # fmt: skip
        if out_dir.exists():
            out_dir.rmdir()
        os.replace(staging, out_dir)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return out_dir


def _write_json(path: Path, value: dict) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(value, f, indent=2)
        f.write("\n")
