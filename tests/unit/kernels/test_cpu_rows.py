"""The native row operations of a CPU step (csrc/rows.c) against torch: greedy sampling's argmax
against ``max(dim=-1).indices``, the embedding lookup against indexing."""

from __future__ import annotations

import pytest
import torch

from shared.engine.model_runner import select_rows
from shared.engine.sampler import greedy_argmax
from shared.kernels import cpu_kernels

pytestmark = pytest.mark.skipif(cpu_kernels.load() is None, reason="no C compiler to build the CPU kernels")


@pytest.mark.parametrize("rows,size", [(1, 1), (3, 7), (64, 7168), (9, 33), (200, 1000)])  # 64 x 7168 runs on the pool
def test_argmax_matches_torch(rows, size):
    gen = torch.Generator().manual_seed(rows * 31 + size)
    wide = torch.randn(rows, size + 5, generator=gen)
    x = wide[:, 2 : 2 + size]  # strided rows
    ids = cpu_kernels.argmax(x)
    assert ids is not None and ids.dtype == torch.int64
    assert torch.equal(ids, x.max(dim=-1).indices)
    assert torch.equal(greedy_argmax(x), ids)


def test_argmax_ties_infinities_and_nan_as_torch():
    x = torch.randn(8, 45, generator=torch.Generator().manual_seed(0))
    x[0] = 1.0  # all equal: the first
    x[1, [4, 20, 40]] = 9.0  # tied maxima: the first of them
    x[2] = float("-inf")
    x[3, 30] = float("inf")
    x[4, 44] = float("nan")  # a NaN in the scalar tail, after the maximum
    x[5, [3, 17]] = float("nan")  # the first NaN wins
    x[6, 40] = 50.0
    x[6, 41] = float("nan")
    x[7, [0, 44]] = 7.0
    ids = cpu_kernels.argmax(x)
    assert ids is not None
    assert torch.equal(ids, x.max(dim=-1).indices)
    assert ids.tolist()[:6] == [0, 4, 0, 30, 44, 3]


def test_argmax_declines_what_it_does_not_handle():
    assert cpu_kernels.argmax(torch.randn(4, 8, dtype=torch.float64)) is None
    assert cpu_kernels.argmax(torch.randn(4, 8).t()) is None  # columns, not rows, contiguous
    assert cpu_kernels.argmax(torch.randn(2, 3, 4)) is None
    x = torch.randn(8, 4, dtype=torch.float64)
    assert torch.equal(greedy_argmax(x), x.max(dim=-1).indices)  # torch's reduction instead


def test_gather_rows_matches_indexing():
    gen = torch.Generator().manual_seed(3)
    table = torch.randn(50, 24, generator=gen)
    ids = torch.tensor([3, 0, 49, 3, 17])
    out = cpu_kernels.gather_rows(table, ids)
    assert out is not None and torch.equal(out, table[ids])
    assert torch.equal(select_rows(table, [0, 4, 49]), table[[0, 4, 49]])
    empty = cpu_kernels.gather_rows(table, torch.tensor([], dtype=torch.int64))
    assert empty is not None and empty.shape == (0, 24)


@pytest.mark.parametrize("bad", [50, -1])
def test_gather_rows_refuses_ids_outside_the_table(bad):
    with pytest.raises(IndexError, match=f"index {bad} is out of range"):
        cpu_kernels.gather_rows(torch.randn(50, 8), torch.tensor([1, bad]))
    assert cpu_kernels.gather_rows(torch.randn(50, 8).t().contiguous().t(), torch.tensor([1])) is None  # columns
