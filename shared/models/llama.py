"""Llama-family decoder over a paged KV cache.

One module covers LlamaForCausalLM (incl. Llama 3 ``llama3`` rope scaling),
MistralForCausalLM, Qwen2ForCausalLM (q/k/v bias) and Qwen3ForCausalLM
(per-head q/k RMSNorm), with grouped-query attention and tied or untied
embeddings. Numerics follow Hugging Face's op order (RMSNorm in float32 then
cast, cos/sin computed in float32 then cast, residual adds in the model dtype)
so logits match transformers on the same checkpoint.

Projections are fused (q|k|v and gate|up); ``checkpoint_tensors`` says which
Hugging Face tensor fills which slice, and the loader copies them in.
Attention is full causal attention: a checkpoint's sliding window (see
``ModelConfig.sliding_window``) is not applied, so callers cap the context there.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Iterator
from typing import cast

import torch
import torch.nn.functional as F
from torch import nn

from shared.kernels import cpu_kernels
from shared.kernels.metadata import AttentionMetadata
from shared.models.config import ModelConfig, ModelLoadError
from shared.models.cpu_stack import CpuStack

SUPPORTED_ROPE_TYPES = ("default", "llama3")


def rope_type_of(config: ModelConfig) -> str:
    if not config.rope_scaling:
        return "default"
    return str(config.rope_scaling.get("rope_type", config.rope_scaling.get("type", "default")))


def rope_inv_freq(config: ModelConfig) -> torch.Tensor:  # [head_dim // 2] float32
    """Inverse rotary frequencies, with Llama 3 frequency-dependent scaling when configured."""
    rope_type = rope_type_of(config)
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ModelLoadError(
            f"config.json: rope type {rope_type!r} is not supported; supported types are "
            f"{', '.join(SUPPORTED_ROPE_TYPES)}"
        )
    dim = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    if rope_type == "default":
        return inv_freq
    scaling = config.rope_scaling or {}
    try:
        factor = float(scaling["factor"])
        low_freq_factor = float(scaling["low_freq_factor"])
        high_freq_factor = float(scaling["high_freq_factor"])
        old_context_len = float(scaling["original_max_position_embeddings"])
    except KeyError as e:
        raise ModelLoadError(f"config.json: llama3 rope scaling is missing {e.args[0]!r}") from None
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    # Long wavelengths are slowed by `factor`, short ones kept, the band between interpolated.
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def rope_cos_sin(config: ModelConfig, device: torch.device | str) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin tables for every position: each [max_position_embeddings, head_dim] float32."""
    inv_freq = rope_inv_freq(config).to(device)
    positions = torch.arange(config.max_position_embeddings, device=device, dtype=torch.int64).float()
    freqs = positions[:, None] * inv_freq[None, :]  # [max_pos, head_dim // 2]
    emb = torch.cat((freqs, freqs), dim=-1)  # [max_pos, head_dim]
    return emb.cos(), emb.sin()


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x: [num_tokens, heads, head_dim]; cos/sin: [num_tokens, 1, head_dim] in x's dtype
    return x * cos + rotate_half(x) * sin


class Linear(nn.Linear):
    """``nn.Linear`` whose parameters are left as allocated: the loader fills them from the checkpoint.

    Initialising parameters on the meta device runs torch's Python reference ops, which import
    ``torch._dynamo`` (sympy, triton): about a second and 150 MB of every worker process, for nothing.
    """

    def reset_parameters(self) -> None:
        pass

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # float32 on the CPU: the native kernel (batch-invariant rows; the one-call forward uses it too)
        out = cpu_kernels.linear(x, self.weight)
        if out is None:
            return F.linear(x, self.weight, self.bias)
        return out if self.bias is None else out.add_(self.bias)


class Embedding(nn.Embedding):
    """``nn.Embedding`` left uninitialised, as ``Linear``; its table may be held as its bfloat16 copy
    (``cpu_kernels.hold_as_bfloat16``)."""

    def reset_parameters(self) -> None:
        pass

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        if cpu_kernels.held_shape(self.weight) is None:
            return super().forward(input)
        rows = cpu_kernels.gather_rows(self.weight, input.reshape(-1).to(torch.int64))
        assert rows is not None, "a table held as its bfloat16 copy is on the CPU with the native kernels"
        return rows.view(*input.shape, rows.shape[-1])


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() == 2 and (fused := cpu_kernels.rms_norm(x, self.weight, self.eps)) is not None:
            return fused  # float32 on the CPU: one pass
        input_dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(input_dtype)


class Attention(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.num_heads = config.num_heads
        self.num_kv_heads = config.num_kv_heads
        self.head_dim = config.head_dim
        self.q_size = config.num_heads * config.head_dim
        self.kv_size = config.num_kv_heads * config.head_dim
        self.scale = config.head_dim**-0.5
        # Qwen2's bias covers q/k/v only; Llama/Qwen3 `attention_bias` covers o_proj too.
        o_bias = config.qkv_bias and config.architecture != "Qwen2ForCausalLM"
        self.qkv_proj = Linear(config.hidden_size, self.q_size + 2 * self.kv_size, bias=config.qkv_bias)
        self.o_proj = Linear(self.q_size, config.hidden_size, bias=o_bias)
        self.q_norm = RMSNorm(config.head_dim, config.rms_norm_eps) if config.qk_norm else None
        self.k_norm = RMSNorm(config.head_dim, config.rms_norm_eps) if config.qk_norm else None

    def forward(
        self,
        hidden: torch.Tensor,  # [num_tokens, hidden_size]
        cos: torch.Tensor,  # [num_tokens, head_dim]
        sin: torch.Tensor,
        kv_cache: torch.Tensor,  # [num_blocks, 2, block_size, num_kv_heads, head_dim]
        meta: AttentionMetadata,
        attn_backend,
    ) -> torch.Tensor:
        num_tokens = hidden.shape[0]
        qkv = self.qkv_proj(hidden)  # [T, q_size + 2 * kv_size]
        # float32 on the CPU: q and k rotate in place, in one pass (cos/sin are then [T, head_dim]).
        rotated = self.q_norm is None and cpu_kernels.rope_(qkv, self.num_heads + self.num_kv_heads, cos, sin)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(num_tokens, self.num_heads, self.head_dim)  # [T, num_heads, head_dim]
        k = k.view(num_tokens, self.num_kv_heads, self.head_dim)  # [T, num_kv_heads, head_dim]
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)  # [T, num_kv_heads, head_dim]
        if self.q_norm is not None and self.k_norm is not None:
            q = self.q_norm(q)
            k = self.k_norm(k)
        if not rotated:
            q = apply_rope(q, cos.unsqueeze(1), sin.unsqueeze(1))
            k = apply_rope(k, cos.unsqueeze(1), sin.unsqueeze(1))
        k_cache, v_cache = kv_cache[:, 0], kv_cache[:, 1]  # [num_blocks, block_size, num_kv_heads, head_dim]
        attn_backend.write_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        out = attn_backend.forward(q, k_cache, v_cache, meta, self.scale)  # [T, num_heads, head_dim]
        return self.o_proj(out.reshape(num_tokens, self.q_size))  # [T, hidden_size]


class MLP(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.intermediate_size = config.intermediate_size
        self.gate_up_proj = Linear(config.hidden_size, 2 * config.intermediate_size, bias=False)
        self.down_proj = Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)  # [T, 2 * intermediate]
        if (fused := cpu_kernels.silu_mul(gate_up, self.intermediate_size)) is not None:
            return self.down_proj(fused)  # float32 on the CPU: one pass
        gate, up = gate_up.split(self.intermediate_size, dim=-1)  # each [T, intermediate]
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config)

    def forward(self, hidden, cos, sin, kv_cache, meta, attn_backend) -> torch.Tensor:
        # Separate residual adds (not a fused add+norm) keep bfloat16 rounding identical to HF.
        residual = hidden
        hidden = self.self_attn(self.input_layernorm(hidden), cos, sin, kv_cache, meta, attn_backend)
        hidden = residual + hidden
        residual = hidden
        hidden = self.mlp(self.post_attention_layernorm(hidden))
        return residual + hidden

    def forward_fused(
        self, hidden: torch.Tensor | None, residual: torch.Tensor, cos, sin, kv_cache, meta, attn_backend
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """float32 on the CPU (``cpu_kernels.fuses_residual``): ``forward`` with each residual add
        fused into the norm after it.

        ``hidden`` is the previous layer's MLP output still to be added to ``residual``, or None
        before the first layer (``residual`` is then the embedding, a fresh tensor that becomes the
        residual stream, updated in place). Returns this layer's (MLP output, residual).
        """
        normed = self.input_layernorm(residual) if hidden is None else add_norm_(hidden, residual, self.input_layernorm)
        attn_out = self.self_attn(normed, cos, sin, kv_cache, meta, attn_backend)
        return self.mlp(add_norm_(attn_out, residual, self.post_attention_layernorm)), residual


def add_norm_(x: torch.Tensor, residual: torch.Tensor, norm: RMSNorm) -> torch.Tensor:
    """``residual += x`` in place, then ``norm(residual)``, in one pass (where ``fuses_residual`` holds)."""
    out = cpu_kernels.add_rms_norm_(x, residual, norm.weight, norm.eps)
    assert out is not None, "add_norm_ needs cpu_kernels.fuses_residual"
    return out


class LlamaModel(nn.Module):
    """Decoder stack plus LM head. Parameters start uninitialised; the loader fills them."""

    rope_cos: torch.Tensor  # [max_positions, head_dim] float32 buffer
    rope_sin: torch.Tensor

    def __init__(
        self, config: ModelConfig, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu"
    ) -> None:
        super().__init__()
        self.config = config
        self.dtype = dtype
        cos, sin = rope_cos_sin(config, device)  # validates the rope type before allocating weights
        with torch.device("meta"):
            self.embed_tokens = Embedding(config.vocab_size, config.hidden_size)
            self.layers = nn.ModuleList(DecoderLayer(config) for _ in range(config.num_layers))
            self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
            self.lm_head = (
                None if config.tie_word_embeddings else Linear(config.hidden_size, config.vocab_size, bias=False)
            )
        self.to(dtype)  # still on meta: no memory is touched
        self.to_empty(device=device)
        # Kept in float32 and cast per step, as HF casts its float32 cos/sin to the activation dtype.
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        self._cpu_stacks: dict[type, CpuStack | None] = {}

    def forward(
        self,
        input_ids: torch.Tensor,  # [num_tokens] int64
        positions: torch.Tensor,  # [num_tokens] int64
        kv_cache: torch.Tensor,  # [num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim]
        meta: AttentionMetadata,
        attn_backend,
        before_compute: Callable[[], None] | None = None,  # runs once, as late as the compute allows
    ) -> torch.Tensor:  # [num_tokens, hidden_size]
        stack = self.cpu_stack(attn_backend)
        if stack is not None and stack.supports(kv_cache, meta):
            # The same ops as one native call; None if an attention kernel declined (out of scratch memory).
            hidden_out = stack.forward(input_ids, positions, kv_cache, meta, before_compute)
            if hidden_out is not None:
                return hidden_out
            before_compute = None  # it ran
        if before_compute is not None:
            before_compute()
        hidden = self.embed_tokens(input_ids)  # [T, hidden_size]
        cos = self.rope_cos.index_select(0, positions).to(hidden.dtype)  # [T, head_dim]
        sin = self.rope_sin.index_select(0, positions).to(hidden.dtype)  # [T, head_dim]
        if cpu_kernels.fuses_residual(hidden):
            mlp_out: torch.Tensor | None = None
            residual = hidden
            for layer_idx, layer in enumerate(self.decoder_layers()):
                mlp_out, residual = layer.forward_fused(
                    mlp_out, residual, cos, sin, kv_cache[:, layer_idx], meta, attn_backend
                )
            return self.norm(residual) if mlp_out is None else add_norm_(mlp_out, residual, self.norm)
        for layer_idx, layer in enumerate(self.decoder_layers()):
            hidden = layer(hidden, cos, sin, kv_cache[:, layer_idx], meta, attn_backend)
        return self.norm(hidden)

    def cpu_stack(self, attn_backend) -> CpuStack | None:
        """The float32 CPU forward as one native call (``CpuStack``), where it applies; built once per
        backend type (its checks see the loaded weights). ``CLEAVE_CPU_STACK=0`` turns it off."""
        key = type(attn_backend)
        if key not in self._cpu_stacks:
            enabled = os.environ.get("CLEAVE_CPU_STACK", "1") != "0"
            self._cpu_stacks[key] = CpuStack.build(self, attn_backend) if enabled else None
        return self._cpu_stacks[key]

    def decoder_layers(self) -> list[DecoderLayer]:
        return [cast(DecoderLayer, layer) for layer in self.layers]

    def projection_weights(self) -> list[torch.Tensor]:
        """Every matrix a token's hidden state is multiplied by: the layers' four projections and the LM head."""
        weights = [m.weight for la in self.decoder_layers()
                   for m in (la.self_attn.qkv_proj, la.self_attn.o_proj, la.mlp.gate_up_proj, la.mlp.down_proj)]  # fmt: skip
        return [*weights, self.output_weight]

    @property
    def output_weight(self) -> torch.Tensor:
        """The LM head's weight [vocab, hidden]: the embedding's where the checkpoint ties them."""
        return self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [N, hidden] -> [N, vocab] float32
        weight = self.output_weight
        logits = cpu_kernels.linear(hidden, weight)
        return (F.linear(hidden, weight) if logits is None else logits).float()

    def checkpoint_tensors(self) -> Iterator[tuple[str, torch.Tensor | cpu_kernels.StagedRows]]:
        """(Hugging Face tensor name, destination view) for every weight the checkpoint must provide.

        Each destination has the exact shape the checkpoint tensor must have;
        fused projections hand out row slices of their weight. A weight held as its bfloat16
        copy (``cpu_kernels.hold_as_bfloat16``) hands out rows of its float32 staging instead,
        packed into it once they have all arrived.
        """
        stagings: dict[int, cpu_kernels.BFloat16Staging] = {}

        def rows(weight: torch.Tensor, start: int, count: int) -> torch.Tensor | cpu_kernels.StagedRows:
            if cpu_kernels.held_shape(weight) is None:
                return weight.data[start : start + count]
            if id(weight) not in stagings:
                stagings[id(weight)] = cpu_kernels.BFloat16Staging(weight)
            return stagings[id(weight)].rows(start, count)

        yield "model.embed_tokens.weight", rows(self.embed_tokens.weight, 0, self.embed_tokens.num_embeddings)
        for i, layer in enumerate(self.decoder_layers()):
            prefix = f"model.layers.{i}"
            attn, mlp = layer.self_attn, layer.mlp
            q_rows, kv_rows = attn.q_size, attn.kv_size
            qkv_slices = {"q_proj": (0, q_rows), "k_proj": (q_rows, kv_rows), "v_proj": (q_rows + kv_rows, kv_rows)}
            for name, (start, size) in qkv_slices.items():
                yield f"{prefix}.self_attn.{name}.weight", rows(attn.qkv_proj.weight, start, size)
                if attn.qkv_proj.bias is not None:
                    yield f"{prefix}.self_attn.{name}.bias", attn.qkv_proj.bias.data[start : start + size]
            yield f"{prefix}.self_attn.o_proj.weight", rows(attn.o_proj.weight, 0, attn.o_proj.out_features)
            if attn.o_proj.bias is not None:
                yield f"{prefix}.self_attn.o_proj.bias", attn.o_proj.bias.data
            if attn.q_norm is not None and attn.k_norm is not None:
                yield f"{prefix}.self_attn.q_norm.weight", attn.q_norm.weight.data
                yield f"{prefix}.self_attn.k_norm.weight", attn.k_norm.weight.data
            inter = mlp.intermediate_size
            yield f"{prefix}.mlp.gate_proj.weight", rows(mlp.gate_up_proj.weight, 0, inter)
            yield f"{prefix}.mlp.up_proj.weight", rows(mlp.gate_up_proj.weight, inter, inter)
            yield f"{prefix}.mlp.down_proj.weight", rows(mlp.down_proj.weight, 0, mlp.down_proj.out_features)
            yield f"{prefix}.input_layernorm.weight", layer.input_layernorm.weight.data
            yield f"{prefix}.post_attention_layernorm.weight", layer.post_attention_layernorm.weight.data
        yield "model.norm.weight", self.norm.weight.data
        if self.lm_head is not None:
            yield "lm_head.weight", rows(self.lm_head.weight, 0, self.lm_head.out_features)
