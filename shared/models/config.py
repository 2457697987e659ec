"""Model geometry read from a Hugging Face ``config.json`` (torch-free).

Both rope layouts in circulation are accepted: top-level ``rope_theta`` /
``rope_scaling`` (most published checkpoints) and ``rope_parameters`` (what
current transformers writes).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

SUPPORTED_ARCHITECTURES = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
)


class ModelLoadError(ValueError):
    """A checkpoint directory that cannot be served; the message names the file."""


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool = False
    qk_norm: bool = False
    rope_scaling: dict[str, Any] | None = field(default=None, hash=False, compare=False)
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    torch_dtype: str = "float32"
    # Attention window the checkpoint was trained with (None: full attention). The
    # model attends over the whole context, so serving caps the context here.
    sliding_window: int | None = None

    @property
    def kv_bytes_per_token_per_elem(self) -> int:
        """K and V elements per token across all layers (multiply by dtype size)."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim

    @property
    def layer_parameters(self) -> int:
        """Weights of the decoder layers' projections: what every prompt token multiplies (norms and
        biases aside)."""
        h, q, kv = self.hidden_size, self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        return self.num_layers * (h * (q + 2 * kv) + q * h + 3 * h * self.intermediate_size)

    @property
    def num_parameters(self) -> int:
        """Weights of the decoder (norms and biases aside, a fraction of a percent)."""
        h = self.hidden_size
        return self.layer_parameters + self.vocab_size * h * (1 if self.tie_word_embeddings else 2)

    def geometry_key(self) -> str:
        """Stable description of the KV geometry (feeds the compatibility hash)."""
        return (
            f"{self.architecture}:L{self.num_layers}:H{self.num_heads}:KV{self.num_kv_heads}"
            f":D{self.head_dim}:V{self.vocab_size}:hid{self.hidden_size}"
        )


def _read_json(path: Path) -> dict[str, Any]:
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except FileNotFoundError:
        raise ModelLoadError(f"{path}: file not found; a model directory needs config.json") from None
    except json.JSONDecodeError as e:
        raise ModelLoadError(f"{path}: not valid JSON ({e})") from None


def _rope_settings(cfg: dict[str, Any]) -> tuple[float, dict[str, Any] | None]:
    params = cfg.get("rope_parameters")
    if isinstance(params, dict):
        theta = float(params.get("rope_theta", cfg.get("rope_theta", 10000.0)))
        rope_type = params.get("rope_type", params.get("type", "default"))
        scaling = None if rope_type == "default" else dict(params)
        return theta, scaling
    theta = float(cfg.get("rope_theta", 10000.0))
    scaling = cfg.get("rope_scaling")
    if scaling is not None:
        rope_type = scaling.get("rope_type", scaling.get("type", "default"))
        if rope_type == "default":
            scaling = None
    return theta, scaling


def _eos_ids(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, int):
        return (value,)
    return tuple(int(v) for v in value)


def load_model_config(model_dir: str | Path) -> ModelConfig:
    """Parse ``config.json`` (and ``generation_config.json`` EOS ids, if present), or a ``.gguf`` file's metadata."""
    if str(model_dir).lower().endswith(".gguf"):
        from shared.models.gguf_file import open_gguf

        checkpoint = open_gguf(os.path.abspath(model_dir))
        return model_config_from_dict(checkpoint.hf_config(), checkpoint.hf_generation_config(), checkpoint.path)
    model_dir = Path(model_dir)
    if not model_dir.is_dir():
        raise ModelLoadError(f"{model_dir}: model directory not found")
    path = model_dir / "config.json"
    gen_path = model_dir / "generation_config.json"
    return model_config_from_dict(_read_json(path), _read_json(gen_path) if gen_path.exists() else {}, path)


def model_config_from_dict(cfg: dict[str, Any], generation_cfg: dict[str, Any], path: Path) -> ModelConfig:
    """Build a ``ModelConfig`` from ``config.json`` contents; ``path`` names the source in errors."""
    archs = cfg.get("architectures") or []
    arch = archs[0] if archs else None
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ModelLoadError(
            f"{path}: architecture {arch!r} is not supported; expected one of {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    for key in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads"):
        if key not in cfg:
            raise ModelLoadError(f"{path}: missing required field {key!r}")
    num_heads = int(cfg["num_attention_heads"])
    num_kv_heads = int(cfg.get("num_key_value_heads") or num_heads)
    head_dim = int(cfg.get("head_dim") or cfg["hidden_size"] // num_heads)
    if num_heads % num_kv_heads:
        raise ModelLoadError(
            f"{path}: num_attention_heads={num_heads} is not a multiple of num_key_value_heads={num_kv_heads}"
        )
    rope_theta, rope_scaling = _rope_settings(cfg)
    eos = set(_eos_ids(cfg.get("eos_token_id")))
    eos |= set(_eos_ids(generation_cfg.get("eos_token_id")))
    dtype = cfg.get("torch_dtype") or cfg.get("dtype") or "float32"
    qkv_bias = arch == "Qwen2ForCausalLM" or bool(cfg.get("attention_bias", False))
    # Qwen configs carry a window that is only used when use_sliding_window is set.
    uses_window = arch == "MistralForCausalLM" or bool(cfg.get("use_sliding_window", False))
    sliding_window = cfg.get("sliding_window") if uses_window else None
    return ModelConfig(
        architecture=arch,
        vocab_size=int(cfg["vocab_size"]),
        hidden_size=int(cfg["hidden_size"]),
        intermediate_size=int(cfg["intermediate_size"]),
        num_layers=int(cfg["num_hidden_layers"]),
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        rope_theta=rope_theta,
        max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        qkv_bias=qkv_bias,
        qk_norm=arch == "Qwen3ForCausalLM",
        rope_scaling=rope_scaling,
        bos_token_id=cfg.get("bos_token_id"),
        eos_token_ids=tuple(sorted(eos)),
        torch_dtype=str(dtype),
        sliding_window=int(sliding_window) if sliding_window else None,
    )
