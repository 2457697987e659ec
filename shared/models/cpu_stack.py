"""The decoder stack's float32 CPU forward without module dispatch.

``LlamaModel.forward`` on the CPU in float32 runs the fused residual path: per
layer an add-and-norm, the q|k|v projection, RoPE in place, the KV write,
paged attention, the output projection, another add-and-norm, gate|up, SiLU × up
and the down projection. ``CpuStack`` runs the same native kernels and the same
``F.linear`` calls in the same order on the same inputs, so its output is
bit-identical; what it drops is the Python around them: nine module calls per
layer, the kernels' per-call layout checks (done once here, where they cannot
change: weights, the cache layout) and the per-layer conversions of the step's
metadata (done once per step). That overhead is a fixed cost of every step,
which at small decode batches is a third of the step.

Where torch's BLAS exports ``sgemm_`` (the routine its CPU ``F.linear`` calls), the whole stack
runs as one native call (``csrc/llama_forward.c``) with the same arguments to every routine: no
Python between the ops, and no interpreter lock held during the step's compute, so the worker's
event loop streams tokens on the other core meanwhile instead of stalling the engine thread.
"""

from __future__ import annotations

import ctypes
import logging
import os
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F

from shared.kernels import cpu_kernels, torch_ref
from shared.kernels.metadata import AttentionMetadata

if TYPE_CHECKING:
    from shared.models.llama import LlamaModel

MAX_GROUP, MAX_HEAD_DIM, MAX_BLOCK = 16, 256, 64  # what the native attention kernels handle

logger = logging.getLogger("cleave.kernels")


class _LayerWeights(ctypes.Structure):
    _fields_ = [(name, ctypes.c_void_p) for name in ("qkv_weight", "o_weight", "gate_up_weight", "down_weight",
                                                      "input_norm", "post_norm")] + [
        ("input_eps", ctypes.c_float), ("post_eps", ctypes.c_float)]  # fmt: skip


class _ForwardArgs(ctypes.Structure):
    _fields_ = [
        ("sgemm", ctypes.c_void_p),
        *[(name, ctypes.c_int) for name in ("num_tokens", "hidden", "q_size", "kv_size", "intermediate", "num_heads",
                                             "num_kv_heads", "head_dim", "num_layers", "block_size", "num_seqs",
                                             "max_seq_len", "is_decode")],
        ("scale", ctypes.c_float), ("final_eps", ctypes.c_float), ("final_norm", ctypes.c_void_p),
        ("kv_cache", ctypes.c_void_p),
        *[(name, ctypes.c_int64) for name in ("block_stride", "row_stride", "layer_stride", "value_offset")],
        ("slot_mapping", ctypes.c_void_p), ("block_tables", ctypes.c_void_p), ("seq_lens", ctypes.c_void_p),
        ("query_start_loc", ctypes.c_void_p), ("bt_stride", ctypes.c_int64), ("cos", ctypes.c_void_p),
        ("sin", ctypes.c_void_p), ("residual", ctypes.c_void_p), ("out", ctypes.c_void_p),
        ("scratch", ctypes.c_void_p),
    ]  # fmt: skip


def torch_sgemm() -> int | None:
    """The address of the BLAS ``sgemm_`` torch's CPU library exports (MKL on x86 wheels), or None."""
    path = os.path.join(os.path.dirname(torch.__file__), "lib", "libtorch_cpu.so")
    try:
        return ctypes.cast(ctypes.CDLL(path).sgemm_, ctypes.c_void_p).value
    except (OSError, AttributeError):
        return None


class CpuStack:
    def __init__(self, model: LlamaModel, lib: ctypes.CDLL) -> None:
        self.model, self.lib = model, lib
        config = model.config
        self.num_heads, self.num_kv_heads, self.head_dim = config.num_heads, config.num_kv_heads, config.head_dim
        self.q_size, self.kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.intermediate = config.intermediate_size
        self.hidden_size = config.hidden_size
        layers = model.decoder_layers()
        self.scale = layers[0].self_attn.scale
        self.eps = [(ctypes.c_float(la.input_layernorm.eps), ctypes.c_float(la.post_attention_layernorm.eps))
                    for la in layers]  # fmt: skip
        self.final_eps = ctypes.c_float(model.norm.eps)
        # The one-call forward: the library must have it (an older prebuilt one may not) and torch's sgemm_.
        self.sgemm = torch_sgemm() if os.environ.get("CLEAVE_CPU_NATIVE_FORWARD", "1") != "0" else None
        self.native: Any = None  # llama_forward_f32, declared
        if self.sgemm is not None and hasattr(lib, "llama_forward_f32"):
            self.native = lib.llama_forward_f32
            self.native.argtypes = [ctypes.POINTER(_ForwardArgs), ctypes.POINTER(_LayerWeights)]
            self.native.restype = ctypes.c_int
            self._point_at_weights()
        logger.info("cpu_stack native_forward=%s", self.native is not None)

    def _weight_ptrs(self) -> list[int]:
        return [p.data_ptr() for p in self.model.parameters()]

    def _point_at_weights(self) -> None:
        """The layers' weight addresses as the native forward reads them (again if a weight moved)."""
        layers = self.model.decoder_layers()
        self.layer_weights = (_LayerWeights * len(layers))(*[
            _LayerWeights(la.self_attn.qkv_proj.weight.data_ptr(), la.self_attn.o_proj.weight.data_ptr(),
                          la.mlp.gate_up_proj.weight.data_ptr(), la.mlp.down_proj.weight.data_ptr(),
                          la.input_layernorm.weight.data_ptr(), la.post_attention_layernorm.weight.data_ptr(),
                          la.input_layernorm.eps, la.post_attention_layernorm.eps)
            for la in layers
        ])  # fmt: skip
        self.weight_ptrs = self._weight_ptrs()

    @staticmethod
    def applies(model: LlamaModel, attn_backend) -> bool:
        """float32 weights on the CPU, the native kernels built, and nothing the fused path does not do."""
        config = model.config
        layers = model.decoder_layers()
        return (
            model.dtype == torch.float32
            and model.embed_tokens.weight.device.type == "cpu"
            and isinstance(attn_backend, torch_ref.TorchAttentionBackend)
            and cpu_kernels.load() is not None
            and config.num_heads % config.num_kv_heads == 0
            and config.num_heads // config.num_kv_heads <= MAX_GROUP
            and config.head_dim <= MAX_HEAD_DIM
            and all(
                la.self_attn.q_norm is None and la.self_attn.qkv_proj.bias is None and la.self_attn.o_proj.bias is None
                for la in layers
            )
            and all(p.is_contiguous() for p in model.parameters())
        )

    def supports(self, kv_cache: torch.Tensor, meta: AttentionMetadata) -> bool:
        """The cache layout the kernels read: [blocks, layers, 2, block_size, kv_heads, head_dim], rows contiguous."""
        return (
            kv_cache.dtype == torch.float32
            and kv_cache.dim() == 6
            and kv_cache.shape[3] == meta.block_size <= MAX_BLOCK
            and kv_cache.stride()[4:] == (self.head_dim, 1)
        )

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        before_compute: Callable[[], None] | None = None,
    ) -> torch.Tensor:  # [num_tokens, hidden_size]
        """``before_compute`` runs once, right before the native call that holds no GIL (the first op else)."""
        model, lib = self.model, self.lib
        hidden = model.embed_tokens(input_ids)  # [T, hidden]
        cos = model.rope_cos[positions].to(hidden.dtype)  # [T, head_dim]
        sin = model.rope_sin[positions].to(hidden.dtype)
        if self.native is not None:
            final = self._native_forward(hidden, cos, sin, kv_cache, meta, before_compute)
            if final is not None:
                return final
            hidden = model.embed_tokens(input_ids)  # the attention kernel declined: the residual is spent
        elif before_compute is not None:
            before_compute()
        num_tokens, hidden_size = hidden.shape
        head_dim = self.head_dim
        # Per step: the metadata as the kernels take it, and the cache's geometry.
        slot_mapping = meta.slot_mapping.to(torch.int64).contiguous()
        block_tables = meta.block_tables.to(torch.int32).contiguous()
        seq_lens = meta.seq_lens.to(torch.int32).contiguous()
        query_start_loc = meta.query_start_loc.to(torch.int32).contiguous()
        block_stride, row_stride = kv_cache.stride(0), kv_cache.stride(3)
        layer_bytes, value_bytes = kv_cache.stride(1) * 4, kv_cache.stride(2) * 4
        cache_base = kv_cache.data_ptr()
        decode = meta.is_pure_decode
        residual = hidden
        mlp_out: torch.Tensor | None = None
        residual_ptr, cos_ptr, sin_ptr = residual.data_ptr(), cos.data_ptr(), sin.data_ptr()
        for index, layer in enumerate(model.decoder_layers()):
            attn, mlp = layer.self_attn, layer.mlp
            eps_in, eps_post = self.eps[index]
            normed = torch.empty(num_tokens, hidden_size)
            if mlp_out is None:
                lib.rms_norm_f32(residual_ptr, hidden_size, layer.input_layernorm.weight.data_ptr(), normed.data_ptr(),
                                 hidden_size, num_tokens, hidden_size, eps_in)  # fmt: skip
            else:
                lib.add_rms_norm_f32(mlp_out.data_ptr(), hidden_size, residual_ptr, hidden_size,
                                     layer.input_layernorm.weight.data_ptr(), normed.data_ptr(), hidden_size,
                                     num_tokens, hidden_size, eps_in)  # fmt: skip
            qkv = F.linear(normed, attn.qkv_proj.weight)  # [T, q_size + 2 * kv_size]
            qkv_ptr, qkv_stride = qkv.data_ptr(), qkv.stride(0)
            lib.rope_f32(
                qkv_ptr, qkv_stride, num_tokens, self.num_heads + self.num_kv_heads, head_dim, cos_ptr, sin_ptr
            )
            k_cache_ptr = cache_base + index * layer_bytes
            v_cache_ptr = k_cache_ptr + value_bytes
            lib.write_kv_f32(qkv_ptr + self.q_size * 4, qkv_ptr + (self.q_size + self.kv_size) * 4, qkv_stride,
                             qkv_stride, k_cache_ptr, v_cache_ptr, block_stride, row_stride, slot_mapping.data_ptr(),
                             num_tokens, self.kv_size, meta.block_size)  # fmt: skip
            query = qkv[:, : self.q_size].contiguous().view(num_tokens, self.num_heads, head_dim)  # [T, heads, hd]
            out = torch.empty_like(query)
            if decode:
                status = lib.paged_decode_f32(
                    query.data_ptr(), out.data_ptr(), k_cache_ptr, v_cache_ptr, block_stride, row_stride,
                    block_tables.data_ptr(), block_tables.stride(0), seq_lens.data_ptr(), meta.num_seqs,
                    self.num_heads, self.num_kv_heads, head_dim, meta.block_size, self.scale, meta.max_seq_len,
                )  # fmt: skip
            else:
                status = lib.paged_prefill_f32(
                    query.data_ptr(), out.data_ptr(), k_cache_ptr, v_cache_ptr, block_stride, row_stride,
                    block_tables.data_ptr(), block_tables.stride(0), query_start_loc.data_ptr(), seq_lens.data_ptr(),
                    meta.num_seqs, self.num_heads, self.num_kv_heads, head_dim, meta.block_size, self.scale,
                )  # fmt: skip
            if status != 0:  # the kernel declined (out of scratch memory): the backend's other route
                layer_cache = kv_cache[:, index]
                out = torch_ref.paged_attention_fast(query, layer_cache[:, 0], layer_cache[:, 1], meta, self.scale)
            o = F.linear(out.reshape(num_tokens, self.q_size), attn.o_proj.weight)  # [T, hidden]
            normed = torch.empty(num_tokens, hidden_size)
            lib.add_rms_norm_f32(o.data_ptr(), hidden_size, residual_ptr, hidden_size,
                                 layer.post_attention_layernorm.weight.data_ptr(), normed.data_ptr(), hidden_size,
                                 num_tokens, hidden_size, eps_post)  # fmt: skip
            gate_up = F.linear(normed, mlp.gate_up_proj.weight)  # [T, 2 * intermediate]
            act = torch.empty(num_tokens, self.intermediate)
            lib.silu_mul_f32(gate_up.data_ptr(), gate_up.stride(0), act.data_ptr(), num_tokens, self.intermediate)
            mlp_out = F.linear(act, mlp.down_proj.weight)  # [T, hidden]
        final = torch.empty(num_tokens, hidden_size)
        if mlp_out is None:
            lib.rms_norm_f32(residual_ptr, hidden_size, model.norm.weight.data_ptr(), final.data_ptr(), hidden_size,
                             num_tokens, hidden_size, self.final_eps)  # fmt: skip
        else:
            lib.add_rms_norm_f32(mlp_out.data_ptr(), hidden_size, residual_ptr, hidden_size,
                                 model.norm.weight.data_ptr(), final.data_ptr(), hidden_size, num_tokens, hidden_size,
                                 self.final_eps)  # fmt: skip
        return final

    def _native_forward(
        self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv_cache: torch.Tensor,
        meta: AttentionMetadata, before_compute: Callable[[], None] | None,
    ) -> torch.Tensor | None:  # fmt: skip
        """The whole stack in ``llama_forward_f32``; None if its attention kernel declined."""
        if self._weight_ptrs() != self.weight_ptrs:  # a parameter was replaced since the last step
            self._point_at_weights()
        num_tokens = hidden.shape[0]
        model = self.model
        slot_mapping = meta.slot_mapping.to(torch.int64).contiguous()
        block_tables = meta.block_tables.to(torch.int32).contiguous()
        seq_lens = meta.seq_lens.to(torch.int32).contiguous()
        query_start_loc = meta.query_start_loc.to(torch.int32).contiguous()
        scratch = torch.empty(num_tokens * (3 * self.hidden_size + self.q_size + 2 * self.kv_size + 2 * self.q_size
                                            + 3 * self.intermediate))  # fmt: skip
        final = torch.empty(num_tokens, self.hidden_size)
        args = _ForwardArgs(
            self.sgemm, num_tokens, self.hidden_size, self.q_size, self.kv_size, self.intermediate, self.num_heads,
            self.num_kv_heads, self.head_dim, len(self.layer_weights), meta.block_size, meta.num_seqs,
            meta.max_seq_len, int(meta.is_pure_decode), self.scale, self.final_eps, model.norm.weight.data_ptr(),
            kv_cache.data_ptr(), kv_cache.stride(0), kv_cache.stride(3), kv_cache.stride(1), kv_cache.stride(2),
            slot_mapping.data_ptr(), block_tables.data_ptr(), seq_lens.data_ptr(), query_start_loc.data_ptr(),
            block_tables.stride(0), cos.data_ptr(), sin.data_ptr(), hidden.data_ptr(), final.data_ptr(),
            scratch.data_ptr(),
        )  # fmt: skip
        if before_compute is not None:
            before_compute()
        status = self.native(ctypes.byref(args), self.layer_weights)
        return final if status == 0 else None
