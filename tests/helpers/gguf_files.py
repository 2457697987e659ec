"""Tiny GGUF files written in the test, the way llama.cpp's converter writes them.

``write_gguf`` takes a tiny Hugging Face checkpoint (``tests.helpers.checkpoints``)
and writes it with the ``gguf`` package's ``GGUFWriter``: llama.cpp tensor
names, Q/K rows permuted for the ``llama`` architecture, 2-D weights quantised
to the requested type, the demo tokenizer as a ``gpt2`` (byte-level BPE)
vocabulary with its merges, and the chat template.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from safetensors.numpy import load_file

GGUF_ARCH = {"LlamaForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2", "Qwen3ForCausalLM": "qwen3"}

_LAYER_NAMES = {
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.q_proj.bias": "attn_q.bias",
    "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.bias": "attn_v.bias",
    "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}
_GLOBAL_NAMES = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
                 "lm_head.weight": "output.weight"}  # fmt: skip


def gguf_name(hf_name: str) -> str:
    if hf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[hf_name]
    _, _, layer, rest = hf_name.split(".", 3)  # model.layers.N.rest
    return f"blk.{layer}.{_LAYER_NAMES[rest]}"


def llama_cpp_permute(weights: np.ndarray, num_heads: int) -> np.ndarray:
    """llama.cpp's ``LlamaModel.permute``: per head, interleave the two rotary halves."""
    return weights.reshape(num_heads, 2, weights.shape[0] // num_heads // 2, *weights.shape[1:]).swapaxes(1, 2).reshape(weights.shape)  # fmt: skip


def _add_tokenizer(writer, model_dir: Path) -> None:
    tok = json.loads((model_dir / "tokenizer.json").read_text())
    tok_config = json.loads((model_dir / "tokenizer_config.json").read_text())
    vocab = dict(tok["model"]["vocab"])
    specials = {entry["content"]: entry["id"] for entry in tok["added_tokens"]}
    vocab.update(specials)
    tokens = [t for t, _ in sorted(vocab.items(), key=lambda item: item[1])]
    assert [vocab[t] for t in tokens] == list(range(len(tokens)))
    merges = [m if isinstance(m, str) else " ".join(m) for m in tok["model"]["merges"]]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types([3 if t in specials else 1 for t in tokens])
    writer.add_token_merges(merges)
    writer.add_bos_token_id(specials[tok_config["bos_token"]])
    writer.add_eos_token_id(specials[tok_config["eos_token"]])
    writer.add_add_bos_token(True)  # the demo tokenizer's post-processor prepends BOS
    writer.add_chat_template(tok_config["chat_template"])


def write_gguf(model_dir: Path, path: Path, qtype: str = "F32", architecture: str | None = None) -> Path:
    """Write the checkpoint in ``model_dir`` as a GGUF file with 2-D weights of type ``qtype``."""
    from gguf import GGMLQuantizationType, GGUFWriter
    from gguf.quants import quantize

    config = json.loads((model_dir / "config.json").read_text())
    arch = architecture or GGUF_ARCH[config["architectures"][0]]
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    rope = config.get("rope_parameters") or {}
    writer = GGUFWriter(str(path), arch)
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_key_length(config["head_dim"])
    writer.add_value_length(config["head_dim"])
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    writer.add_rope_freq_base(rope.get("rope_theta", config.get("rope_theta", 10000.0)))
    writer.add_vocab_size(config["vocab_size"])
    _add_tokenizer(writer, model_dir)
    quant = GGMLQuantizationType[qtype]
    for name, weights in sorted(load_file(str(model_dir / "model.safetensors")).items()):
        if arch == "llama" and ".q_proj." in name:
            weights = llama_cpp_permute(weights, heads)
        elif arch == "llama" and ".k_proj." in name:
            weights = llama_cpp_permute(weights, kv_heads)
        if weights.ndim == 2 and quant != GGMLQuantizationType.F32:
            writer.add_tensor(gguf_name(name), quantize(weights, quant), raw_dtype=quant)
        else:
            writer.add_tensor(gguf_name(name), np.ascontiguousarray(weights, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def quant_roundtrip(weights: np.ndarray, qtype: str) -> np.ndarray:
    """What a weight becomes after quantising to ``qtype`` and back (the loader's expected output)."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize, quantize

    if weights.ndim != 2 or qtype == "F32":
        return weights.astype(np.float32)
    quant = GGMLQuantizationType[qtype]
    return dequantize(quantize(weights, quant), quant).reshape(weights.shape).astype(np.float32)
