"""The native float32 projection (``cpu_kernels.linear``): correct to float32 rounding, and a row's
result independent of the rows computed with it (batch size, position in the batch, tile shape)."""

from __future__ import annotations

import pytest
import torch

from shared.kernels import cpu_kernels

pytestmark = pytest.mark.skipif(
    not cpu_kernels.native_linear(), reason="the native projection needs AVX-512 or AVX2 with FMA"
)

# (rows, out features, in features): the model's shapes, and odd ones that leave partial tiles and a k tail
SHAPES = [(1, 640, 384), (3, 384, 384), (5, 2048, 384), (7, 384, 1024), (17, 7168, 384), (33, 100, 37), (2, 5, 3)]


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
