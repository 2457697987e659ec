"""The decoder stack's float32 CPU forward as one native call.

``LlamaModel.forward`` on the CPU in float32 runs the fused residual path: per
layer an add-and-norm, the q|k|v projection, RoPE in place, the KV write,
paged attention, the output projection, another add-and-norm, gate|up, SiLU × up
and the down projection. ``CpuStack`` runs the same native kernels in the same
order on the same inputs in one call (``csrc/llama_forward.c``), the projections
on the same kernel as the Python path's (``cpu_kernels.linear`` where it runs,
else the BLAS ``sgemm_`` that torch's CPU ``F.linear`` calls, with the same
arguments), so its output is bit-identical. What it drops is the Python around
the ops (module calls, per-call layout checks, per-layer metadata conversions:
a fixed cost of every step, a third of a small decode step), and it holds no
interpreter lock while it computes, so the worker's event loop streams tokens on
the other core meanwhile instead of stalling the engine thread.
"""

from __future__ import annotations

import ctypes
import os
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from shared.kernels import cpu_kernels, torch_ref
from shared.kernels.metadata import AttentionMetadata

if TYPE_CHECKING:
    from shared.models.llama import LlamaModel

MAX_GROUP, MAX_HEAD_DIM, MAX_BLOCK = 16, 256, 64  # what the native attention kernels handle


class _LayerWeights(ctypes.Structure):
    _fields_ = [(name, ctypes.c_void_p) for name in ("qkv_weight", "o_weight", "gate_up_weight", "down_weight",
                                                      "input_norm", "post_norm", "qkv_packed", "o_packed",
                                                      "gate_up_packed", "down_packed", "qkv_amx", "o_amx",
                                                      "gate_up_amx", "down_amx")] + [
        ("input_eps", ctypes.c_float), ("post_eps", ctypes.c_float)]  # fmt: skip


PROJECTIONS = 4  # the first four of a layer's weight modules: their packed copies follow the norms


class _ForwardArgs(ctypes.Structure):
    _fields_ = [
        ("sgemm", ctypes.c_void_p),
        *[(name, ctypes.c_int) for name in ("num_tokens", "hidden", "q_size", "kv_size", "intermediate", "num_heads",
                                             "num_kv_heads", "head_dim", "num_layers", "block_size", "num_seqs",
                                             "max_seq_len", "is_decode", "kv_kind")],
        ("scale", ctypes.c_float), ("final_eps", ctypes.c_float), ("final_norm", ctypes.c_void_p),
        ("kv_cache", ctypes.c_void_p),
        *[(name, ctypes.c_int64) for name in ("block_stride", "row_stride", "layer_stride", "value_offset")],
        ("slot_mapping", ctypes.c_void_p), ("block_tables", ctypes.c_void_p), ("seq_lens", ctypes.c_void_p),
        ("query_start_loc", ctypes.c_void_p), ("bt_stride", ctypes.c_int64), ("cos", ctypes.c_void_p),
        ("sin", ctypes.c_void_p), ("residual", ctypes.c_void_p), ("out", ctypes.c_void_p),
        ("scratch", ctypes.c_void_p),
    ]  # fmt: skip


def _layer_weight_modules(layer) -> tuple:
    """The modules whose weights the native forward reads for one layer, in ``_LayerWeights``' order."""
    attn, mlp = layer.self_attn, layer.mlp
    return (
        attn.qkv_proj,
        attn.o_proj,
        mlp.gate_up_proj,
        mlp.down_proj,
        layer.input_layernorm,
        layer.post_attention_layernorm,
    )


def torch_sgemm() -> int | None:
    """The address of the BLAS ``sgemm_`` torch's CPU library exports (MKL on x86 wheels), or None."""
    path = os.path.join(os.path.dirname(torch.__file__), "lib", "libtorch_cpu.so")
    try:
        return ctypes.cast(ctypes.CDLL(path).sgemm_, ctypes.c_void_p).value
    except (OSError, AttributeError):
        return None


class CpuStack:
    def __init__(self, model: LlamaModel, lib: ctypes.CDLL, sgemm: int | None) -> None:
        self.model, self.sgemm = model, sgemm
        config = model.config
        self.num_heads, self.num_kv_heads, self.head_dim = config.num_heads, config.num_kv_heads, config.head_dim
        self.q_size, self.kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.intermediate = config.intermediate_size
        self.hidden_size = config.hidden_size
        self.scale = model.decoder_layers()[0].self_attn.scale
        self.native = lib.llama_forward_f32
        self.native.argtypes = [ctypes.POINTER(_ForwardArgs), ctypes.POINTER(_LayerWeights)]
        self.native.restype = ctypes.c_int
        self.scratch_floats = lib.llama_forward_scratch_floats
        self.scratch_floats.argtypes = [ctypes.c_int] * 5
        self.scratch_floats.restype = ctypes.c_int64
        self._point_at_weights()

    @staticmethod
    def build(model: LlamaModel, attn_backend) -> CpuStack | None:
        """The stack for ``model`` where it applies: float32 weights on the CPU, the native kernels
        built (with ``llama_forward_f32``: an older prebuilt library may lack it), the projections'
        kernel found (``cpu_kernels.linear``, else torch's ``sgemm_``), and nothing the fused path
        does not do."""
        config = model.config
        layers = model.decoder_layers()
        lib = cpu_kernels.load()
        applies = (
            model.dtype == torch.float32
            and model.embed_tokens.weight.device.type == "cpu"
            and isinstance(attn_backend, torch_ref.TorchAttentionBackend)
            and lib is not None
            and hasattr(lib, "llama_forward_f32")
            and hasattr(lib, "paged_decode_e4m3")  # built from sources whose ForwardArgs has kv_kind
            and config.num_heads % config.num_kv_heads == 0
            and config.num_heads // config.num_kv_heads <= MAX_GROUP
            and config.head_dim <= MAX_HEAD_DIM
            and all(
                la.self_attn.q_norm is None and la.self_attn.qkv_proj.bias is None and la.self_attn.o_proj.bias is None
                for la in layers
            )
            and all(p.is_contiguous() for p in model.parameters())
        )
        if not applies or lib is None:
            return None
        if cpu_kernels.native_linear():
            return CpuStack(model, lib, None)  # NULL sgemm: the library's own linear_f32
        sgemm = torch_sgemm()
        return None if sgemm is None else CpuStack(model, lib, sgemm)

    def _weight_ptrs(self) -> list[tuple[int, int]]:
        """The addresses and versions of the weights the native forward reads, from the modules that hold
        them (walking ``model.parameters()`` every step cost 0.37 ms, a fortieth of a small step). A weight
        replaced on its module (``module.weight = ...``), moved, or written in place (whose packed copy
        is then stale) is seen; the modules are taken once."""
        weights = [module._parameters["weight"] for module in self._weight_modules]
        return [(w.data_ptr(), w._version) for w in weights]  # type: ignore[union-attr]

    def _point_at_weights(self) -> None:
        """The layers' weight addresses as the native forward reads them (again if a weight moved)."""
        layers = self.model.decoder_layers()
        groups = [_layer_weight_modules(la) for la in layers]
        self._weight_modules = [module for group in groups for module in group]
        self.weight_ptrs = self._weight_ptrs()
        size = len(groups[0]) if groups else 0

        def copies(module) -> tuple[int | None, int | None]:
            """A projection's (packed, AMX) copy where the native kernels read one; neither on torch's BLAS."""
            held = cpu_kernels.held_shape(module.weight) is not None
            tiles, packed = cpu_kernels.kernel_copies(module.weight) if self.sgemm is None or held else (None, None)
            return (None if packed is None else packed.data_ptr()), (None if tiles is None else tiles.data_ptr())

        def layer(i: int, la, group) -> _LayerWeights:
            packed, amx = zip(*[copies(module) for module in group[:PROJECTIONS]], strict=True)
            # NULL for a weight held as its bfloat16 copy: there is no float32 matrix to fall back on
            ptrs = [None if cpu_kernels.held_shape(module.weight) is not None else ptr
                    for module, (ptr, _) in zip(group, self.weight_ptrs[i * size : (i + 1) * size], strict=True)]  # fmt: skip
            return _LayerWeights(*ptrs, *packed, *amx, la.input_layernorm.eps, la.post_attention_layernorm.eps)

        self.layer_weights = (_LayerWeights * len(layers))(
            *[layer(i, la, group) for i, (la, group) in enumerate(zip(layers, groups, strict=True))]
        )

    def supports(self, kv_cache: torch.Tensor, meta: AttentionMetadata) -> bool:
        """The cache layout the kernels read: [blocks, layers, 2, block_size, kv_heads, head_dim], rows contiguous,
        float32, bfloat16 or float8."""
        return (
            cpu_kernels.kv_cache_supported(kv_cache.dtype)
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
    ) -> torch.Tensor | None:  # [num_tokens, hidden_size], or None if an attention kernel declined
        """``before_compute`` runs once, right before the native call (which holds no GIL). On None the
        KV writes it made are rewritten identically by whichever path runs the step instead."""
        if self._weight_ptrs() != self.weight_ptrs:  # a parameter was replaced since the last step
            self._point_at_weights()
        model = self.model
        hidden = cpu_kernels.gather_rows(model.embed_tokens.weight, input_ids)  # [T, hidden]: the residual
        if hidden is None:  # stream, updated in place
            hidden = model.embed_tokens(input_ids)
        # index_select, not [positions]: torch's indexing starts a parallel region even for a few rows, and
        # its threads then spin for milliseconds on the core the native forward's helper needs.
        cos = model.rope_cos.index_select(0, positions).to(hidden.dtype)  # [T, head_dim]
        sin = model.rope_sin.index_select(0, positions).to(hidden.dtype)
        num_tokens = hidden.shape[0]
        slot_mapping = meta.slot_mapping.to(torch.int64).contiguous()
        block_tables = meta.block_tables.to(torch.int32).contiguous()
        seq_lens = meta.seq_lens.to(torch.int32).contiguous()
        query_start_loc = meta.query_start_loc.to(torch.int32).contiguous()
        scratch = torch.empty(
            self.scratch_floats(num_tokens, self.hidden_size, self.q_size, self.kv_size, self.intermediate)
        )
        final = torch.empty(num_tokens, self.hidden_size)
        args = _ForwardArgs(
            self.sgemm, num_tokens, self.hidden_size, self.q_size, self.kv_size, self.intermediate, self.num_heads,
            self.num_kv_heads, self.head_dim, len(self.layer_weights), meta.block_size, meta.num_seqs,
            meta.max_seq_len, int(meta.is_pure_decode), cpu_kernels.KV_KIND[kv_cache.dtype], self.scale,
            model.norm.eps, model.norm.weight.data_ptr(), kv_cache.data_ptr(), kv_cache.stride(0), kv_cache.stride(3),
            kv_cache.stride(1), kv_cache.stride(2),
            slot_mapping.data_ptr(), block_tables.data_ptr(), seq_lens.data_ptr(), query_start_loc.data_ptr(),
            block_tables.stride(0), cos.data_ptr(), sin.data_ptr(), hidden.data_ptr(), final.data_ptr(),
            scratch.data_ptr(),
        )  # fmt: skip
        if before_compute is not None:
            before_compute()
        status = self.native(ctypes.byref(args), self.layer_weights)
        return final if status == 0 else None
