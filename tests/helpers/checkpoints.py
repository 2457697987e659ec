"""Tiny random-weight Hugging Face checkpoints for model and engine tests.

Each checkpoint is written by transformers itself (config class +
``save_pretrained``), so the files look exactly like published ones, and
carries the demo tokenizer (trained once per process).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from shared.models.demo import (
    SPECIAL_TOKENS,
    demo_vocab_size,
    save_quietly,
    write_generation_config,
    write_tokenizer_files,
)

ARCHES = ("llama", "llama3", "mistral", "qwen2", "qwen3")

TINY_SIZES = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "max_position_embeddings": 256,
    "rms_norm_eps": 1e-6,
}

# Low/high wavelength bounds (64/4=16 .. 64/1=64) fall inside the tiny head's
# wavelength range, so all three llama3 branches (keep, interpolate, scale) apply.
LLAMA3_ROPE_SCALING = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
}


def _config_class(arch: str):
    from transformers import LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config

    classes = {
        "llama": LlamaConfig,
        "llama3": LlamaConfig,
        "mistral": MistralConfig,
        "qwen2": Qwen2Config,
        "qwen3": Qwen3Config,
    }
    if arch not in classes:
        raise ValueError(f"unknown test architecture {arch!r}; expected one of {ARCHES}")
    return classes[arch]


def _arch_defaults(arch: str) -> dict[str, Any]:
    if arch == "qwen3":
        # head_dim * heads != hidden_size, as in real Qwen3 models.
        return {"head_dim": 32, "tie_word_embeddings": True}
    if arch == "qwen2":
        return {"tie_word_embeddings": True}
    return {"tie_word_embeddings": False}


def _randomize(model: torch.nn.Module, seed: int) -> None:
    """Weights large enough that logits spread over O(1), so comparisons are meaningful."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in sorted(model.named_parameters()):
            noise = torch.randn(param.shape, generator=gen)
            if name.endswith("norm.weight"):
                param.copy_(1.0 + 0.2 * noise)
            elif name.endswith(".bias"):
                param.copy_(0.2 * noise)
            elif "embed_tokens" in name:
                param.copy_(noise)
            else:
                param.copy_(noise / param.shape[-1] ** 0.5)


def _move_rope_to_top_level(config_path: Path) -> None:
    """Rewrite ``rope_parameters`` as the older top-level ``rope_theta``/``rope_scaling`` layout."""
    cfg = json.loads(config_path.read_text())
    params = dict(cfg.pop("rope_parameters"))
    cfg["rope_theta"] = params.pop("rope_theta")
    cfg["rope_scaling"] = None if params.get("rope_type", "default") == "default" else params
    config_path.write_text(json.dumps(cfg, indent=2))


def make_checkpoint(
    model_dir: str | Path,
    arch: str,
    *,
    seed: int = 0,
    dtype: str = "float32",
    rope_layout: str = "parameters",
    tie_word_embeddings: bool | None = None,
    rope_scaling: dict[str, Any] | None = None,
    **overrides: Any,
) -> Path:
    """Write a tiny random checkpoint of ``arch`` into ``model_dir`` and return the directory."""
    from transformers import AutoModelForCausalLM

    if rope_layout not in ("parameters", "toplevel"):
        raise ValueError(f"rope_layout must be 'parameters' or 'toplevel', got {rope_layout!r}")
    model_dir = Path(model_dir)
    special_ids = write_tokenizer_files(model_dir)
    settings: dict[str, Any] = {**TINY_SIZES, **_arch_defaults(arch)}
    if tie_word_embeddings is not None:
        settings["tie_word_embeddings"] = tie_word_embeddings
    if rope_scaling is None and arch == "llama3":
        rope_scaling = LLAMA3_ROPE_SCALING
    rope_theta = overrides.pop("rope_theta", 10000.0)
    settings["rope_parameters"] = {"rope_type": "default", "rope_theta": rope_theta, **(rope_scaling or {})}
    settings.update(overrides)
    config = _config_class(arch)(
        vocab_size=demo_vocab_size(),
        bos_token_id=special_ids[SPECIAL_TOKENS[0]],
        eos_token_id=special_ids[SPECIAL_TOKENS[1]],
        **settings,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config)
    _randomize(model, seed)
    model = model.to(getattr(torch, dtype))
    save_quietly(model, model_dir)
    write_generation_config(model_dir, special_ids)
    if rope_layout == "toplevel":
        _move_rope_to_top_level(model_dir / "config.json")
    return model_dir
