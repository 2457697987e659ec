"""Random sampling's native draw (csrc/sample.c, ``cpu_kernels.sample_race``): the exponential race over
a row of probabilities, its noise a function of the row's key alone."""

from __future__ import annotations

import pytest
import torch

from shared.engine.sampler import Sampler, SamplingBatch
from shared.engine.sampling_params import SamplingParams
from shared.kernels import cpu_kernels

pytestmark = pytest.mark.skipif(cpu_kernels.load() is None, reason="no C compiler to build the CPU kernels")


def test_frequencies_follow_the_probabilities():
    probs = torch.tensor([0.5, 0.25, 0.15, 0.07, 0.03, 0.0])
    draws = 100_000
    ids = cpu_kernels.sample_race(probs.expand(draws, 6).contiguous(), torch.arange(draws))
    assert ids is not None and ids.dtype == torch.int64
    frequencies = torch.bincount(ids, minlength=6).double() / draws
    # Four standard deviations of a binomial frequency at most; a zero probability never wins.
    sigma = (probs.double() * (1 - probs.double()) / draws).sqrt()
    assert ((frequencies - probs.double()).abs() <= 4 * sigma + 1e-12).all(), frequencies
    assert frequencies[5] == 0


def test_a_row_draws_from_its_key_alone():
    gen = torch.Generator().manual_seed(0)
    probs = torch.randn(40, 7168, generator=gen).softmax(dim=-1)
    keys = torch.randint(-(2**63), 2**63 - 1, (40,), generator=gen)
    together = cpu_kernels.sample_race(probs, keys)  # 40 x 7168 runs on the pool
    assert together is not None
    for r in (0, 17, 39):
        alone = cpu_kernels.sample_race(probs[r : r + 1], keys[r : r + 1])
        assert alone is not None and alone.item() == together[r].item()
    again = cpu_kernels.sample_race(probs, keys)
    assert again is not None and torch.equal(again, together)
    other = cpu_kernels.sample_race(probs, keys + 1)
    assert other is not None and not torch.equal(other, together)  # 40 rows of a flat distribution


def test_strided_rows_edge_values_and_what_it_declines():
    wide = torch.zeros(4, 12)
    probs = wide[:, 1:11]  # strided rows
    probs[0, 3] = 1.0  # a sure token
    probs[1, 9] = 1.0  # in the last position
    probs[2] = 0.1
    probs[3, 2] = float("nan")  # a NaN wins, as in torch's argmax of the quotients
    ids = cpu_kernels.sample_race(probs, torch.tensor([5, 6, 7, 8]))
    assert ids is not None
    assert ids[0] == 3 and ids[1] == 9 and 0 <= ids[2] < 10 and ids[3] == 2
    assert cpu_kernels.sample_race(probs.double(), torch.zeros(4, dtype=torch.int64)) is None
    assert cpu_kernels.sample_race(probs.t(), torch.zeros(10, dtype=torch.int64)) is None


def test_unseeded_rows_draw_from_the_global_generator():
    """An unseeded row's key comes from torch's global generator: ``torch.manual_seed`` repeats a run."""
    vocab = 64
    logits = torch.randn(3, vocab, generator=torch.Generator().manual_seed(3))
    params = [SamplingParams(temperature=1.0)] * 3
    batch = SamplingBatch.build(params, [[0]] * 3, [[]] * 3, [None] * 3, [1], vocab, "cpu")
    runs = []
    for _ in range(2):
        torch.manual_seed(5)
        runs.append(Sampler()(logits, batch).token_ids)
    assert torch.equal(runs[0], runs[1])
    draws = {tuple(Sampler()(logits, batch).token_ids.tolist()) for _ in range(20)}
    assert len(draws) > 1  # the global generator moves on
