"""Attention backends: the torch reference (CPU) and Triton kernels (CUDA).

Importing this package imports neither torch nor triton; ``get_attention_backend``
imports only the backend it returns.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

BACKEND_NAMES = ("auto", "torch", "triton")


def get_attention_backend(device: torch.device | str, name: str = "auto"):
    """The attention backend for ``device``: Triton on CUDA when triton imports, torch otherwise.

    ``name`` forces a backend: "torch" or "triton" ("auto" chooses as above).
    """
    if name not in BACKEND_NAMES:
        raise ValueError(f"unknown attention backend {name!r}; choose one of {', '.join(BACKEND_NAMES)}")
    device_type = device if isinstance(device, str) else device.type
    if name == "triton" or (name == "auto" and device_type.split(":")[0] == "cuda"):
        try:
            from shared.kernels.triton_attention import TritonAttentionBackend
        except ImportError as exc:
            if name == "triton":
                raise RuntimeError(f"attention backend 'triton' needs a working triton install: {exc}") from exc
        else:
            return TritonAttentionBackend()
    from shared.kernels.torch_ref import TorchAttentionBackend

    return TorchAttentionBackend()
