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


def smaps_entry(address: int) -> dict[str, str]:
    """The kernel's /proc/self/smaps fields of the mapping that holds ``address``."""
    fields: dict[str, str] | None = None
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            head, _, rest = line.partition(" ")
            if "-" in head and all(c in "0123456789abcdef-" for c in head):
                if fields is not None:
                    return fields
                start, end = (int(x, 16) for x in head.split("-"))
                fields = {} if start <= address < end else None
            elif fields is not None:
                fields[head.rstrip(":")] = rest.strip()
    if fields is None:
        raise AssertionError(f"no mapping holds {address:#x}")
    return fields


def vm_flags(address: int) -> set[str]:
    """The mapping's VmFlags ("hg": advised for huge pages)."""
    return set(smaps_entry(address)["VmFlags"].split())


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc/self/smaps: Linux")
@pytest.mark.parametrize("prefault", [True, False])
def test_the_kv_cache_is_resident_from_the_start_unless_asked_not_to(prefault):
    shape = (64, 2, 2, 16, 2, 64)  # 8 MiB: a page the first step touches would otherwise fault then
    kv = allocate_kv_cache(shape, torch.float32, torch.device("cpu"), prefault=prefault)
    resident = int(smaps_entry(kv.data_ptr())["Rss"].split()[0]) * 1024
    if prefault:
        assert resident >= kv.numel() * 4
    else:
        assert resident < kv.numel() * 4 // 4
    assert int(kv.abs().sum()) == 0  # zeroed either way (the sum touches every page)


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
