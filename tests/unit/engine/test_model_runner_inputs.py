"""The model runner's step inputs: integer tensors built from Python lists through C arrays."""

from __future__ import annotations

import gc

import pytest
import torch

from shared.engine.model_runner import int_tensor


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
def test_int_tensor_equals_torch_tensor(dtype):
    values = [0, 1, 7, 2**31 - 1, -5] + list(range(100, 1200))
    built = int_tensor(values, dtype)
    expected = torch.tensor(values, dtype=dtype)
    assert built.dtype == dtype and built.shape == expected.shape
    assert torch.equal(built, expected)
    assert int_tensor([], dtype).shape == (0,) and int_tensor([], dtype).dtype == dtype


def test_int_tensor_outlives_its_list_and_owns_its_values():
    values = list(range(4096))
    built = int_tensor(values, torch.int64)
    values[:] = [-1] * 4096  # the tensor holds a copy, not the list
    del values
    gc.collect()
    _ = [list(range(4096)) for _ in range(64)]  # reuse freed memory
    assert torch.equal(built, torch.arange(4096))


def test_int_tensor_refuses_what_does_not_fit():
    with pytest.raises(OverflowError):
        int_tensor([2**31], torch.int32)
