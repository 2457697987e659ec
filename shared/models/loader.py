"""Load a Hugging Face checkpoint directory into a ``LlamaModel``.

Reads ``model.safetensors`` or the shards listed in
``model.safetensors.index.json``. Every failure raises ``ModelLoadError``
naming the file and what was expected, so an operator can fix the directory.
"""

from __future__ import annotations

import json
import os
from contextlib import ExitStack
from pathlib import Path

import torch
from safetensors import safe_open

from shared.engine.cpu_alloc import huge_page_mapping
from shared.kernels import cpu_kernels
from shared.models.config import ModelConfig, ModelLoadError, load_model_config
from shared.models.llama import LlamaModel

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_dtype(dtype: str, config: ModelConfig) -> torch.dtype:
    """``auto`` means the checkpoint's own dtype."""
    name = config.torch_dtype if dtype == "auto" else dtype
    name = name.removeprefix("torch.")
    if name not in DTYPES:
        raise ModelLoadError(f"dtype {name!r} is not supported; use one of auto, {', '.join(DTYPES)}")
    return DTYPES[name]


def tensor_locations(model_dir: Path) -> dict[str, str]:
    """Map each tensor name to the safetensors file (relative name) that holds it."""
    index_path = model_dir / INDEX_FILE
    single_path = model_dir / SINGLE_FILE
    if index_path.is_file():
        try:
            with open(index_path, encoding="utf-8") as f:
                weight_map = json.load(f)["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise ModelLoadError(f"{index_path}: expected JSON with a 'weight_map' object ({e!r})") from None
        for file_name in sorted(set(weight_map.values())):
            if not (model_dir / file_name).is_file():
                raise ModelLoadError(f"{model_dir / file_name}: file not found (listed in {INDEX_FILE})")
        return dict(weight_map)
    if single_path.is_file():
        with safe_open(str(single_path), framework="pt") as f:
            return {name: SINGLE_FILE for name in f.keys()}
    raise ModelLoadError(f"{model_dir}: no weights found; expected {SINGLE_FILE} or {INDEX_FILE}")


def _missing_tensor_error(model_dir: Path, name: str, sharded: bool) -> ModelLoadError:
    where = INDEX_FILE if sharded else SINGLE_FILE
    return ModelLoadError(f"{model_dir / where}: missing tensor {name}")


def load_weights(model: LlamaModel, model_dir: Path) -> None:
    """Copy every tensor ``model.checkpoint_tensors()`` asks for, checking shapes."""
    locations = tensor_locations(model_dir)
    sharded = (model_dir / INDEX_FILE).is_file()
    with ExitStack() as stack, torch.no_grad():
        handles = {}
        for name, dest in model.checkpoint_tensors():
            file_name = locations.get(name)
            if file_name is None:
                raise _missing_tensor_error(model_dir, name, sharded)
            if file_name not in handles:
                handles[file_name] = stack.enter_context(safe_open(str(model_dir / file_name), framework="pt"))
            handle = handles[file_name]
            if name not in handle.keys():
                raise ModelLoadError(f"{model_dir / file_name}: missing tensor {name} (the index lists it here)")
            shape = list(handle.get_slice(name).get_shape())
            if shape != list(dest.shape):
                raise ModelLoadError(
                    f"{model_dir / file_name}: tensor {name} has shape {shape}, expected {list(dest.shape)}"
                )
            dest.copy_(handle.get_tensor(name))


def load_gguf_weights(model: LlamaModel, path: Path) -> None:
    """Dequantise every tensor of a GGUF file and copy it (cast to the model dtype) into place."""
    from shared.models.gguf_file import open_gguf

    wanted = dict(model.checkpoint_tensors())
    with torch.no_grad():
        for name, weights in open_gguf(os.path.abspath(path)).hf_tensors():
            dest = wanted.pop(name, None)
            if dest is None:
                raise ModelLoadError(f"{path}: tensor {name} does not belong to this model")
            if list(weights.shape) != list(dest.shape):
                raise ModelLoadError(f"{path}: tensor {name} has shape {list(weights.shape)}, expected {list(dest.shape)}")  # fmt: skip
            dest.copy_(torch.from_numpy(weights if weights.flags.writeable else weights.copy()))
    if wanted:
        raise ModelLoadError(f"{path}: missing tensor {sorted(wanted)[0]} ({len(wanted)} missing)")


def load_model(
    model_dir: str | Path, dtype: str = "auto", device: str | torch.device = "cpu", bfloat16_projections: bool = False
) -> tuple[LlamaModel, ModelConfig]:
    """Build the model described by ``config.json`` and fill it from the safetensors files.

    ``model_dir`` may also name a ``.gguf`` file: geometry from its metadata, weights dequantised.
    ``bfloat16_projections`` (a float32 model on the CPU, where ``cpu_kernels.bfloat16_holding``): the
    layers' projections, the LM head and the embedding are held as their bfloat16 copies alone, their
    values rounded to bfloat16 as they load (``cpu_kernels.hold_as_bfloat16``); the norms stay float32.
    """
    model_dir = Path(model_dir)
    config = load_model_config(model_dir)
    model = LlamaModel(config, dtype=resolve_dtype(dtype, config), device=device)
    if bfloat16_projections:
        for weight in {id(w): w for w in [model.embed_tokens.weight, *model.projection_weights()]}.values():
            cpu_kernels.hold_as_bfloat16(weight)
    if model.embed_tokens.weight.device.type == "cpu":
        place_in_huge_pages(model)  # before the weights arrive: nothing to copy, nothing left behind
    if str(model_dir).lower().endswith(".gguf"):
        load_gguf_weights(model, model_dir)
    else:
        load_weights(model, model_dir)
    model.eval()
    return model, config


def place_in_huge_pages(model: torch.nn.Module, align: int = 64) -> None:
    """Give every parameter new, zeroed storage in one mapping backed by huge pages (see ``cpu_alloc``):
    a decode step streams all the weights, and on 4 KiB pages each page costs a TLB miss. Their values
    are not kept: call it before loading the weights (moving loaded weights would leave their old
    storage resident in the heap)."""
    params = list(model.parameters())
    sizes = [p.numel() * p.element_size() for p in params]
    offsets, end = [], 0
    for size in sizes:
        offsets.append(end)
        end += -(-size // align) * align
    buffer, base = huge_page_mapping(end)
    arena = torch.frombuffer(buffer, dtype=torch.uint8, count=end, offset=base)  # keeps the mapping alive
    for p, offset, size in zip(params, offsets, sizes, strict=True):
        p.data = arena[offset : offset + size].view(p.dtype).view(p.shape)
