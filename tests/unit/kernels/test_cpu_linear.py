"""The native float32 projection (``cpu_kernels.linear``): correct to float32 rounding, and a row's
result independent of the rows computed with it (batch size, position in the batch, tile shape)."""

from __future__ import annotations

import gc

import pytest
import torch

from shared.kernels import cpu_kernels

pytestmark = pytest.mark.skipif(
    not cpu_kernels.native_linear(), reason="the native projection needs AVX-512 or AVX2 with FMA"
)

# (rows, out features, in features): the model's shapes, odd ones that leave partial tiles and a k tail,
# and k past the packed kernel's chunk of 1,024 (sums stored and taken up again), evenly or not
SHAPES = [(1, 640, 384), (3, 384, 384), (5, 2048, 384), (7, 384, 1024), (17, 7168, 384), (33, 100, 37), (2, 5, 3),
          (7, 70, 2500), (13, 96, 2048)]  # fmt: skip


@pytest.mark.parametrize("m,n,k", SHAPES)
def test_matches_a_float64_product(m, n, k):
    gen = torch.Generator().manual_seed(m * n + k)
    x, w = torch.randn(m, k, generator=gen), torch.randn(n, k, generator=gen)
    out = cpu_kernels.linear(x, w)
    assert out is not None and out.shape == (m, n) and out.dtype == torch.float32
    expected = x.double() @ w.double().T
    assert (out.double() - expected).abs().max().item() <= 1e-5 * expected.abs().max().item()


@pytest.mark.parametrize("m,n,k", SHAPES)
def test_a_rows_result_does_not_depend_on_the_batch(m, n, k):
    gen = torch.Generator().manual_seed(m + n + k)
    x, w = torch.randn(m, k, generator=gen), torch.randn(n, k, generator=gen)
    whole = cpu_kernels.linear(x, w)
    assert whole is not None
    for i in range(m):  # alone (a 1-row tile), and in every other slice of the batch
        alone = cpu_kernels.linear(x[i : i + 1], w)
        assert alone is not None and torch.equal(alone[0], whole[i])
    for start in range(1, m):
        part = cpu_kernels.linear(x[start:], w)
        assert part is not None and torch.equal(part, whole[start:])


def test_strided_rows_and_leading_dims():
    gen = torch.Generator().manual_seed(0)
    wide = torch.randn(2, 6, 50, generator=gen)
    x = wide[..., 5:45]  # rows 50 apart, 40 features
    w = torch.randn(24, 40, generator=gen)
    out = cpu_kernels.linear(x, w)
    assert out is not None and out.shape == (2, 6, 24)
    torch.testing.assert_close(out, x @ w.T, atol=1e-5, rtol=1e-5)


def test_declines_what_it_does_not_do():
    x, w = torch.randn(3, 8), torch.randn(4, 8)
    assert cpu_kernels.linear(x.double(), w.double()) is None
    assert cpu_kernels.linear(x, w.T.contiguous().T) is None  # weight not contiguous
    assert cpu_kernels.linear(x, torch.randn(4, 9)) is None  # feature mismatch


def test_packed_copy_is_made_again_after_an_in_place_write():
    gen = torch.Generator().manual_seed(3)
    x, w = torch.randn(9, 70, generator=gen), torch.randn(45, 70, generator=gen)
    before = cpu_kernels.linear(x, w)
    w.mul_(2)  # exact: every product and partial sum doubles
    after = cpu_kernels.linear(x, w)
    assert before is not None and after is not None and torch.equal(after, before * 2)
    w.copy_(torch.randn(45, 70, generator=gen))
    expected = x.double() @ w.double().T
    again = cpu_kernels.linear(x, w)
    assert again is not None and (again.double() - expected).abs().max().item() <= 1e-5 * expected.abs().max().item()


def test_packed_and_unpacked_products_agree_to_rounding():
    """Where the library packs weights (AVX-512), the packed product is the one used; both are products."""
    gen = torch.Generator().manual_seed(4)
    x, w = torch.randn(13, 384, generator=gen), torch.randn(200, 384, generator=gen)
    packed = cpu_kernels.packed_weight(w)
    if packed is None:
        pytest.skip("no packed kernel in this build (AVX2)")
    assert packed.numel() == 224 * 384 and packed.data_ptr() % 64 == 0  # 7 panels of 32, the last padded
    assert torch.equal(packed.view(7, 384, 32)[6, :, 8:], torch.zeros(384, 24))
    assert torch.equal(packed.view(7, 384, 32)[1, 5], w[32:64, 5])  # k-major panels
    lib = cpu_kernels.load()
    out = torch.empty(13, 200)
    lib.linear_f32(x.data_ptr(), 384, w.data_ptr(), out.data_ptr(), 200, 13, 200, 384)
    torch.testing.assert_close(cpu_kernels.linear(x, w), out, atol=1e-4, rtol=1e-5)


def test_a_weight_whose_copy_does_not_fit_stays_unpacked(monkeypatch):
    """Refused once, always refused: its results must not change when memory frees up later."""
    gen = torch.Generator().manual_seed(5)
    x, w = torch.randn(4, 64, generator=gen), torch.randn(40, 64, generator=gen)
    lib = cpu_kernels.load()
    if cpu_kernels.packed_weight(torch.randn(40, 64)) is None:
        pytest.skip("no packed kernel in this build (AVX2)")
    monkeypatch.setattr(cpu_kernels, "available_memory_bytes", lambda: 1000)  # less than 4 x the copy
    assert cpu_kernels.packed_weight(w) is None
    monkeypatch.setattr(cpu_kernels, "available_memory_bytes", lambda: 1 << 40)
    assert cpu_kernels.packed_weight(w) is None
    out = torch.empty(4, 40)
    lib.linear_f32(x.data_ptr(), 64, w.data_ptr(), out.data_ptr(), 40, 4, 40, 64)
    assert torch.equal(cpu_kernels.linear(x, w), out)  # the unpacked kernel, bit for bit


def test_packed_copies_stop_at_a_share_of_the_memory_they_could_take(monkeypatch):
    """Each copy small, together too many: packing stops once the process's copies would take more than
    PACK_MEMORY_SHARE of what was available to them, and resumes as copies are freed."""
    if cpu_kernels.packed_weight(torch.randn(32, 64)) is None:
        pytest.skip("no packed kernel in this build (AVX2)")
    gc.collect()
    gc.disable()  # no collection in between frees another test's copies
    try:
        _check_packing_budget(monkeypatch)
    finally:
        gc.enable()


def _check_packing_budget(monkeypatch) -> None:
    held = cpu_kernels._packed_bytes
    size = 32 * 64 * 4  # one panel of 32 columns, k = 64
    # Memory the kernel reports free, fixed, such that exactly three more copies fit (see packed_weight).
    available = 3 * held + 10 * size + size // 2
    monkeypatch.setattr(cpu_kernels, "available_memory_bytes", lambda: available)
    weights = [torch.randn(32, 64) for _ in range(5)]
    packed = [cpu_kernels.packed_weight(w) for w in weights]
    assert [p is not None for p in packed] == [True, True, True, False, False]
    assert cpu_kernels._packed_bytes == held + 3 * size
    del weights[0], packed[0]  # a weight and its copy die: the room is given back
    assert cpu_kernels._packed_bytes == held + 2 * size
    assert cpu_kernels.packed_weight(torch.randn(32, 64)) is not None
