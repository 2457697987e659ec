"""The Cleave engine.

``from shared.engine import LLM, SamplingParams`` is the offline API. Torch-backed
classes load lazily, so torch-free users (the router) can import
``shared.engine.sampling_params`` and friends without pulling in torch.
"""

from __future__ import annotations

from typing import Any

from shared.engine.sampling_params import InvalidRequestError, SamplingParams

__all__ = ["LLM", "EngineCore", "InvalidRequestError", "SamplingParams", "RequestOutput", "CompletionOutput"]

_LAZY = {
    "LLM": "shared.engine.llm",
    "RequestOutput": "shared.engine.llm",
    "CompletionOutput": "shared.engine.llm",
    "EngineCore": "shared.engine.engine_core",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'shared.engine' has no attribute {name!r}")
