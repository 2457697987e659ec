"""Read a GGUF checkpoint as Hugging Face parts (torch-free).

A GGUF file carries the model geometry, the tokenizer and the chat template as
metadata and the weights as (possibly quantised) tensors. This module turns the
metadata into the ``config.json`` / ``generation_config.json`` dicts a Hugging
Face directory would hold, and the tensors into float32 numpy arrays under
Hugging Face names, so the rest of Cleave sees an ordinary checkpoint.

llama.cpp stores the Q and K projections of ``llama``-architecture models with
their rows permuted (rotary halves interleaved per head); ``hf_tensors`` undoes
that, as transformers' GGUF loader does. Qwen2/Qwen3 files are not permuted.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from functools import lru_cache
from pathlib import Path
from typing import Any

import numpy as np

from shared.models.config import ModelLoadError

GGUF_SUFFIX = ".gguf"

# GGUF architecture -> (Hugging Face architecture, Q/K rows permuted by llama.cpp).
ARCHITECTURES = {
    "llama": ("LlamaForCausalLM", True),
    "qwen2": ("Qwen2ForCausalLM", False),
    "qwen3": ("Qwen3ForCausalLM", False),
}

# Tensor types with a numpy dequantiser in the ``gguf`` package.
SUPPORTED_TENSOR_TYPES = frozenset(
    "F32 F16 BF16 Q4_0 Q4_1 Q5_0 Q5_1 Q8_0 Q2_K Q3_K Q4_K Q5_K Q6_K "
    "IQ1_S IQ1_M IQ2_XXS IQ2_XS IQ2_S IQ3_XXS IQ3_S IQ4_NL IQ4_XS TQ1_0 TQ2_0 MXFP4".split()
)

_GLOBAL_TENSORS = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_TENSORS = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_LAYER_NAME = re.compile(r"blk\.(\d+)\.(.+)")


def is_gguf_path(model: str | Path) -> bool:
    """True for a path naming a ``.gguf`` file (the file need not exist yet)."""
    return str(model).lower().endswith(GGUF_SUFFIX)


class GGUFCheckpoint:
    """One opened GGUF file; ``open_gguf`` caches it per process (the reader memory-maps)."""

    def __init__(self, path: str | Path) -> None:
        from gguf import GGUFReader

        self.path = Path(path)
        if not self.path.is_file():
            raise ModelLoadError(f"{self.path}: GGUF file not found")
        try:
            self.reader = GGUFReader(str(self.path))
        except Exception as e:  # the reader raises ValueError/struct.error/... on a damaged file
            raise ModelLoadError(f"{self.path}: not a readable GGUF file ({e})") from None
        self.gguf_architecture = str(self.field("general.architecture", ""))
        if self.gguf_architecture not in ARCHITECTURES:
            raise ModelLoadError(
                f"{self.path}: GGUF architecture {self.gguf_architecture!r} is not supported; "
                f"expected one of {', '.join(ARCHITECTURES)}"
            )
        self.architecture, self.qk_permuted = ARCHITECTURES[self.gguf_architecture]
        self._check_tensors()

    def field(self, key: str, default: Any = None) -> Any:
        """A metadata value (strings, numbers, lists), or ``default`` when absent."""
        entry = self.reader.fields.get(key)
        return default if entry is None else entry.contents()

    def arch_field(self, suffix: str, default: Any = None) -> Any:
        return self.field(f"{self.gguf_architecture}.{suffix}", default)

    def _check_tensors(self) -> None:
        for tensor in self.reader.tensors:
            type_name = tensor.tensor_type.name
            if type_name not in SUPPORTED_TENSOR_TYPES:
                raise ModelLoadError(
                    f"{self.path}: tensor {tensor.name} has type {type_name}, which Cleave cannot dequantise; "
                    f"supported types: {', '.join(sorted(SUPPORTED_TENSOR_TYPES))}"
                )
            if tensor.name == "rope_freqs.weight":
                raise ModelLoadError(
                    f"{self.path}: per-frequency rope factors (rope_freqs.weight) are not supported; "
                    "convert the original Hugging Face checkpoint instead"
                )

    @property
    def tensor_names(self) -> list[str]:
        return [tensor.name for tensor in self.reader.tensors]

    def hf_config(self) -> dict[str, Any]:
        """The ``config.json`` a Hugging Face directory of this model would have."""
        for key in ("embedding_length", "block_count", "feed_forward_length", "attention.head_count"):
            if self.arch_field(key) is None:
                raise ModelLoadError(f"{self.path}: missing metadata {self.gguf_architecture}.{key}")
        num_heads = int(self.arch_field("attention.head_count"))
        hidden = int(self.arch_field("embedding_length"))
        tokens = self.field("tokenizer.ggml.tokens") or []
        config: dict[str, Any] = {
            "architectures": [self.architecture],
            "model_type": self.architecture.removesuffix("ForCausalLM").lower(),
            "vocab_size": int(self.arch_field("vocab_size", len(tokens))),
            "hidden_size": hidden,
            "intermediate_size": int(self.arch_field("feed_forward_length")),
            "num_hidden_layers": int(self.arch_field("block_count")),
            "num_attention_heads": num_heads,
            "num_key_value_heads": int(self.arch_field("attention.head_count_kv", num_heads)),
            "head_dim": int(self.arch_field("attention.key_length", hidden // num_heads)),
            "rms_norm_eps": float(self.arch_field("attention.layer_norm_rms_epsilon", 1e-6)),
            "rope_theta": float(self.arch_field("rope.freq_base", 10000.0)),
            "max_position_embeddings": int(self.arch_field("context_length", 2048)),
            "tie_word_embeddings": "output.weight" not in self.tensor_names,
            "hidden_act": "silu",
            "torch_dtype": "float32",
        }
        if self.architecture == "LlamaForCausalLM":
            config["attention_bias"] = "blk.0.attn_q.bias" in self.tensor_names
        for key, name in (("bos_token_id", "tokenizer.ggml.bos_token_id"), ("eos_token_id", "tokenizer.ggml.eos_token_id")):  # fmt: skip
            value = self.field(name)
            if value is not None:
                config[key] = int(value)
        return config

    def hf_generation_config(self) -> dict[str, Any]:
        """Stop ids: the file's EOS and end-of-turn tokens (llama.cpp stops on both)."""
        eos = [int(v) for v in (self.field("tokenizer.ggml.eos_token_id"), self.field("tokenizer.ggml.eot_token_id")) if v is not None]  # fmt: skip
        config: dict[str, Any] = {"eos_token_id": sorted(set(eos))}
        bos = self.field("tokenizer.ggml.bos_token_id")
        if bos is not None:
            config["bos_token_id"] = int(bos)
        return config

    def hf_name(self, gguf_name: str) -> str | None:
        """The Hugging Face name of a GGUF tensor, or None for one Cleave does not load."""
        if gguf_name in _GLOBAL_TENSORS:
            return _GLOBAL_TENSORS[gguf_name]
        match = _LAYER_NAME.fullmatch(gguf_name)
        if match and match.group(2) in _LAYER_TENSORS:
            return f"model.layers.{match.group(1)}.{_LAYER_TENSORS[match.group(2)]}"
        return None

    def hf_tensors(self) -> Iterator[tuple[str, np.ndarray]]:
        """(Hugging Face name, float32 array in Hugging Face layout) for every weight, dequantised."""
        from gguf.quants import dequantize

        config = self.hf_config()
        for tensor in self.reader.tensors:
            name = self.hf_name(tensor.name)
            if name is None:
                raise ModelLoadError(f"{self.path}: unexpected tensor {tensor.name} for architecture {self.gguf_architecture}")  # fmt: skip
            # numpy shape is the GGUF shape reversed: [out_features, in_features]
            weights = np.asarray(dequantize(tensor.data, tensor.tensor_type), dtype=np.float32)
            weights = weights.reshape([int(d) for d in reversed(tensor.shape)])
            if self.qk_permuted and name.endswith(("q_proj.weight", "q_proj.bias")):
                weights = unpermute_qk(weights, config["num_attention_heads"])
            elif self.qk_permuted and name.endswith(("k_proj.weight", "k_proj.bias")):
                weights = unpermute_qk(weights, config["num_key_value_heads"])
            yield name, weights


def unpermute_qk(weights: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's Q/K row order: per head it stores the rotary halves interleaved.

    llama.cpp writes ``w.reshape(H, 2, D/2, ...).swapaxes(1, 2)``; this is the inverse.
    """
    rows = weights.shape[0]
    half = rows // num_heads // 2
    w = weights.reshape(num_heads, half, 2, *weights.shape[1:])  # [H, D/2, 2, ...]
    return np.ascontiguousarray(w.swapaxes(1, 2).reshape(weights.shape))  # [H*D, ...]


@lru_cache(maxsize=4)
def open_gguf(path: str) -> GGUFCheckpoint:
    """Open (and validate) a GGUF file once per process."""
    return GGUFCheckpoint(path)
