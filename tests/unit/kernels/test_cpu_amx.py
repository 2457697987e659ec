"""Projections of bfloat16-valued weights on AMX or, without it, AVX512-BF16 (``csrc/amx.c`` through
``cpu_kernels.linear``): the product of the bfloat16-rounded activations and the weights summed in float32,
and a row's result independent of the rows computed with it."""

from __future__ import annotations

import pytest
import torch

from shared.kernels import cpu_kernels

pytestmark = pytest.mark.skipif(not cpu_kernels.amx(), reason="neither AMX nor AVX512-BF16 on this CPU")

# (rows, out features, in features): the model's shapes and odd ones (partial tiles, a k tail, one column)
SHAPES = [(1, 640, 384), (3, 384, 384), (16, 2048, 384), (17, 384, 1024), (40, 7168, 384), (33, 100, 37),
          (2, 5, 3), (1, 1, 70), (300, 96, 2048)]  # fmt: skip


def bfloat16_weight(n: int, k: int, gen: torch.Generator) -> torch.Tensor:
    w = torch.randn(n, k, generator=gen).bfloat16().float()
    cpu_kernels.mark_bfloat16_values([w])
    return w


@pytest.mark.parametrize("m,n,k", SHAPES)
def test_matches_the_bfloat16_rounded_product(m, n, k):
    gen = torch.Generator().manual_seed(m * n + k)
    x, w = torch.randn(m, k, generator=gen), bfloat16_weight(n, k, gen)
    out = cpu_kernels.linear(x, w)
    assert cpu_kernels.amx_weight(w) is not None
    assert out is not None and out.shape == (m, n) and out.dtype == torch.float32
    expected = x.bfloat16().double() @ w.double().T
    assert (out.double() - expected).abs().max().item() <= 1e-5 * expected.abs().max().item()
    # and not the float32 product: the activations were rounded
    assert not torch.equal(out, x @ w.T) or k < 8


@pytest.mark.parametrize("m,n,k", SHAPES)
def test_a_rows_result_does_not_depend_on_the_batch(m, n, k):
    gen = torch.Generator().manual_seed(m + n + k)
    x, w = torch.randn(m, k, generator=gen), bfloat16_weight(n, k, gen)
    whole = cpu_kernels.linear(x, w)
    assert whole is not None
    for i in {0, m // 2, m - 1}:
        assert torch.equal(cpu_kernels.linear(x[i : i + 1], w), whole[i : i + 1])


def test_the_unit_is_named():
    assert cpu_kernels.amx_unit() in ("amx", "avx512_bf16")


def test_unmarked_weights_keep_the_float32_product():
    gen = torch.Generator().manual_seed(3)
    x, w = torch.randn(4, 64, generator=gen), torch.randn(32, 64, generator=gen).bfloat16().float()
    assert cpu_kernels.amx_weight(w) is None
    out = cpu_kernels.linear(x, w)
    assert out is not None and (out.double() - x.double() @ w.double().T).abs().max().item() < 1e-4


def test_a_weight_written_in_place_is_packed_again():
    gen = torch.Generator().manual_seed(4)
    x, w = torch.randn(2, 64, generator=gen), bfloat16_weight(48, 64, gen)
    first = cpu_kernels.linear(x, w)
    w.mul_(2)  # exact in bfloat16
    again = cpu_kernels.linear(x, w)
    assert torch.equal(again, first * 2)


def test_an_amx_copy_that_does_not_fit_keeps_the_float32_product(monkeypatch):
    """AMX copies count against the same memory share as the packed float32 ones; a weight whose copy did not
    fit stays on the float32 kernel for good (its results must not change when memory frees up later)."""
    gen = torch.Generator().manual_seed(6)
    x, w = torch.randn(4, 64, generator=gen), bfloat16_weight(40, 64, gen)
    monkeypatch.setattr(cpu_kernels, "available_memory_bytes", lambda: 1000)  # less than 4 x the copy
    assert cpu_kernels.amx_weight(w) is None
    monkeypatch.setattr(cpu_kernels, "available_memory_bytes", lambda: 1 << 40)
    assert cpu_kernels.amx_weight(w) is None
    out = cpu_kernels.linear(x, w)
    assert (out.double() - x.double() @ w.double().T).abs().max().item() < 1e-4  # not rounded to bfloat16
    held = cpu_kernels._packed_bytes
    other = bfloat16_weight(32, 64, gen)
    assert cpu_kernels.amx_weight(other) is not None
    assert cpu_kernels._packed_bytes == held + 32 * 64 * 2


def held_weight(values: torch.Tensor, slices: list[tuple[int, int]]) -> torch.nn.Parameter:
    """A parameter held as its bfloat16 copy (``hold_as_bfloat16``), its rows loaded slice by slice in the
    given order, as the loaders fill one (``BFloat16Staging``)."""
    weight = torch.nn.Parameter(torch.empty(values.shape))
    cpu_kernels.hold_as_bfloat16(weight)
    staging = cpu_kernels.BFloat16Staging(weight)
    for start, count in slices:
        staging.rows(start, count).copy_(values[start : start + count])
    assert staging.values is None  # packed and freed once every row arrived
    return weight


@pytest.mark.skipif(not cpu_kernels.bfloat16_holding(), reason="the library cannot unpack a held weight")
@pytest.mark.parametrize("m,n,k", [(1, 640, 384), (17, 384, 1024), (33, 100, 37), (2, 5, 3)])
def test_a_weight_held_as_its_bfloat16_copy_computes_as_a_marked_one(m, n, k):
    """Held: 2 bytes a value (the padded copy) instead of a float32 matrix beside it; the same products, bit
    for bit, as the marked float32 weight's; its values (rounded to nearest even as they loaded, whatever the
    order of the slices) and its rows as an embedding table come back exactly."""
    gen = torch.Generator().manual_seed(n + k)
    values, x = torch.randn(n, k, generator=gen), torch.randn(m, k, generator=gen)
    rounded = values.bfloat16().float()
    held = held_weight(values, [(n // 2, n - n // 2), (0, n // 2)] if n > 1 else [(0, n)])
    assert held.dtype == torch.bfloat16 and held.dim() == 1 and cpu_kernels.projection_shape(held) == (n, k)
    assert held.numel() * held.element_size() == 2 * (-(-n // 32) * 32) * (-(-k // 32) * 32)
    marked = bfloat16_weight(n, k, gen)
    marked.copy_(rounded)
    out = cpu_kernels.linear(x, held)
    assert cpu_kernels.amx_weight(held) is held
    assert out is not None and torch.equal(out, cpu_kernels.linear(x, marked))
    assert torch.equal(cpu_kernels.unpacked(held), rounded)
    ids = torch.tensor([n - 1, 0, n // 2, n - 1])
    rows = cpu_kernels.gather_rows(held, ids)
    assert rows is not None and torch.equal(rows, rounded[ids])
    with pytest.raises(IndexError):
        cpu_kernels.gather_rows(held, torch.tensor([0, n]))
    with pytest.raises(ValueError, match="float32 CPU rows"):
        cpu_kernels.linear(x.double(), held)


@pytest.mark.skipif(not cpu_kernels.bfloat16_holding(), reason="the library cannot unpack a held weight")
def test_a_held_weight_falls_back_on_its_float32_values(monkeypatch):
    """Where the bfloat16 product cannot run (no memory for the rounded rows), a held weight multiplies as its
    float32 values: there is no float32 matrix to fall back on, so they are unpacked."""
    gen = torch.Generator().manual_seed(11)
    values, x = torch.randn(48, 96, generator=gen).bfloat16().float(), torch.randn(5, 96, generator=gen)
    held = held_weight(values, [(0, 48)])
    lib = cpu_kernels.load()
    monkeypatch.setattr(lib, "linear_amx", lambda *args: -1)
    out = cpu_kernels.linear(x, held)
    assert out is not None and (out.double() - x.double() @ values.double().T).abs().max().item() < 1e-4
