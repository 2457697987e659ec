"""The KV cache and the weights live in mappings advised for huge pages (Linux), 2 MiB aligned."""

from __future__ import annotations

import mmap
import sys

import pytest
import torch

from shared.engine.cpu_alloc import HUGE_PAGE_BYTES, huge_page_mapping
from shared.engine.model_runner import allocate_kv_cache
from shared.models import loader
from shared.models.loader import load_model

linux_thp = pytest.mark.skipif(
    not sys.platform.startswith("linux") or not hasattr(mmap, "MADV_HUGEPAGE"), reason="transparent huge pages: Linux"
)


def vm_flags(address: int) -> set[str]:
    """The kernel's VmFlags of the mapping that holds ``address`` ("hg": advised for huge pages)."""
    region = None
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            head = line.split()[0]
            if "-" in head and all(c in "0123456789abcdef-" for c in head):
                start, end = (int(x, 16) for x in head.split("-"))
                region = start <= address < end
            elif head == "VmFlags:" and region:
                return set(line.split()[1:])
    raise AssertionError(f"no mapping holds {address:#x}")


@linux_thp
def test_a_huge_page_mapping_is_aligned_zeroed_and_advised():
    buffer, offset = huge_page_mapping(3 * HUGE_PAGE_BYTES + 100)
    view = torch.frombuffer(buffer, dtype=torch.uint8, count=3 * HUGE_PAGE_BYTES + 100, offset=offset)
    assert view.data_ptr() % HUGE_PAGE_BYTES == 0
    assert int(view.sum()) == 0
    assert "hg" in vm_flags(view.data_ptr())


@linux_thp
def test_huge_pages_can_be_turned_off(monkeypatch):
    monkeypatch.setenv("CLEAVE_HUGE_PAGES", "0")
    buffer, offset = huge_page_mapping(HUGE_PAGE_BYTES)
    assert offset == 0
    view = torch.frombuffer(buffer, dtype=torch.uint8)
    assert "hg" not in vm_flags(view.data_ptr())


@linux_thp
def test_the_kv_cache_and_the_weights_sit_in_advised_mappings(checkpoint_factory, monkeypatch):
    kv = allocate_kv_cache((8, 2, 2, 4, 2, 16), torch.float32, torch.device("cpu"))
    assert kv.is_contiguous() and kv.shape == (8, 2, 2, 4, 2, 16) and int(kv.abs().sum()) == 0
    assert "hg" in vm_flags(kv.data_ptr())
    model_dir = checkpoint_factory("llama")
    model, _ = load_model(model_dir, "float32")
    params = dict(model.named_parameters())
    assert all(p.is_contiguous() and p.data_ptr() % 64 == 0 for p in params.values())
    assert all("hg" in vm_flags(p.data_ptr()) for p in params.values())
    # the same values as a load into the storage torch allocated
    monkeypatch.setattr(loader, "place_in_huge_pages", lambda model: None)
    plain = dict(load_model(model_dir, "float32")[0].named_parameters())
    assert params.keys() == plain.keys()
    assert all(torch.equal(params[name], plain[name]) for name in params)
