"""``python -m shared.bench.make_checkpoint DIR``: a random-weight checkpoint of a
published model's shape, for benchmarks on machines that cannot download weights.

The default shape is Llama-3.2-1B (hidden 2048, 16 layers, 32 heads, 8 KV heads,
head dim 64, vocabulary 128256, tied embeddings, llama3 rope scaling). Weights are
drawn on ``--device`` in ``--dtype``; the tokenizer files are the demo model's
(smaller vocabulary: use token-id prompts and ``detokenize=False``).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

SHAPES: dict[str, dict[str, Any]] = {
    "llama-3.2-1b": dict(
        hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
        num_key_value_heads=8, head_dim=64, vocab_size=128256, tie_word_embeddings=True,
        max_position_embeddings=131072, rms_norm_eps=1e-5, rope_theta=500000.0,
        rope_scaling={"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                      "original_max_position_embeddings": 8192},
    ),
    # About 12M compute parameters: big enough that the matrix work dominates on a CPU, small
    # enough for a 2-core machine; the CPU throughput comparisons use it.
    "llama-12m": dict(
        hidden_size=384, intermediate_size=1024, num_hidden_layers=6, num_attention_heads=6, num_key_value_heads=2,
        head_dim=64, vocab_size=7168, tie_word_embeddings=False, max_position_embeddings=2048, rms_norm_eps=1e-5,
        rope_theta=10000.0,
    ),
    # The same architecture in miniature, to test this script on a CPU.
    "tiny-llama": dict(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, vocab_size=8192, tie_word_embeddings=True, max_position_embeddings=512, rms_norm_eps=1e-5,
        rope_theta=10000.0,
    ),
}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("dir")
    parser.add_argument("--shape", choices=sorted(SHAPES), default="llama-3.2-1b")
    parser.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)

    import torch
    from safetensors.torch import save_file

    from shared.models.demo import write_generation_config, write_tokenizer_files

    out = Path(args.dir)
    out.mkdir(parents=True, exist_ok=True)
    shape = SHAPES[args.shape]
    special = write_tokenizer_files(out)
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu",
              "torch_dtype": args.dtype, "bos_token_id": 0, "eos_token_id": 1, **shape}  # fmt: skip
    (out / "config.json").write_text(json.dumps(config, indent=2))
    write_generation_config(out, special)
    gen = torch.Generator(device=args.device).manual_seed(args.seed)
    dtype = getattr(torch, args.dtype)
    h, inter, d = shape["hidden_size"], shape["intermediate_size"], shape["head_dim"]
    q_out, kv_out = shape["num_attention_heads"] * d, shape["num_key_value_heads"] * d

    def rand(*size: int) -> torch.Tensor:
        return (torch.randn(*size, generator=gen, device=args.device) * 0.02).to(dtype).cpu()

    tensors = {
        "model.embed_tokens.weight": rand(shape["vocab_size"], h),
        "model.norm.weight": torch.ones(h, dtype=dtype),
    }
    if not shape["tie_word_embeddings"]:
        tensors["lm_head.weight"] = rand(shape["vocab_size"], h)
    for i in range(shape["num_hidden_layers"]):
        p = f"model.layers.{i}."
        tensors.update({
            p + "self_attn.q_proj.weight": rand(q_out, h), p + "self_attn.k_proj.weight": rand(kv_out, h),
            p + "self_attn.v_proj.weight": rand(kv_out, h), p + "self_attn.o_proj.weight": rand(h, q_out),
            p + "mlp.gate_proj.weight": rand(inter, h), p + "mlp.up_proj.weight": rand(inter, h),
            p + "mlp.down_proj.weight": rand(h, inter),
            p + "input_layernorm.weight": torch.ones(h, dtype=dtype),
            p + "post_attention_layernorm.weight": torch.ones(h, dtype=dtype),
        })  # fmt: skip
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    print(f"wrote {args.shape} checkpoint to {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
