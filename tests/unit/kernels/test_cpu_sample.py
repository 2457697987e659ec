"""Sampling's native kernels (csrc/sample.c): the exponential race over a row of logits, its noise a
function of the row's key alone (``cpu_kernels.sample_race``), the top-k / top-p filter
(``cpu_kernels.filter_logits_``) against the sampler's sorting filters, and the penalties
(``cpu_kernels.apply_penalties_``) against its count tensors."""

from __future__ import annotations

import pytest
import torch

from shared.engine.sampler import (
    Sampler,
    SamplingBatch,
    apply_frequency_presence_penalties,
    apply_min_p,
    apply_repetition_penalty,
    apply_top_k,
    apply_top_p,
)
from shared.engine.sampling_params import SamplingParams
from shared.kernels import cpu_kernels

pytestmark = pytest.mark.skipif(cpu_kernels.load() is None, reason="no C compiler to build the CPU kernels")


def test_frequencies_follow_the_probabilities():
    probs = torch.tensor([0.5, 0.25, 0.15, 0.07, 0.03, 0.0])
    draws = 100_000
    logits = probs.log().expand(draws, 6).contiguous()  # the zero probability: a -inf logit
    ids = cpu_kernels.sample_race(logits, torch.ones(draws), torch.arange(draws))
    assert ids is not None and ids.dtype == torch.int64
    frequencies = torch.bincount(ids, minlength=6).double() / draws
    # Four standard deviations of a binomial frequency at most; a zero probability never wins.
    sigma = (probs.double() * (1 - probs.double()) / draws).sqrt()
    assert ((frequencies - probs.double()).abs() <= 4 * sigma + 1e-12).all(), frequencies
    assert frequencies[5] == 0


def test_a_row_draws_from_its_key_alone():
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(40, 7168, generator=gen) * 0.1
    temperature = torch.rand(40, generator=gen) + 0.5
    keys = torch.randint(-(2**63), 2**63 - 1, (40,), generator=gen)
    together = cpu_kernels.sample_race(logits, temperature, keys)  # 40 x 7168 runs on the pool
    assert together is not None
    for r in (0, 17, 39):
        alone = cpu_kernels.sample_race(logits[r : r + 1], temperature[r : r + 1], keys[r : r + 1])
        assert alone is not None and alone.item() == together[r].item()
    again = cpu_kernels.sample_race(logits, temperature, keys)
    assert again is not None and torch.equal(again, together)
    other = cpu_kernels.sample_race(logits, temperature, keys + 1)
    assert other is not None and not torch.equal(other, together)  # 40 rows of a flat distribution


def test_temperature_sharpens_and_flattens():
    logits = torch.tensor([2.0, 1.0, 0.0])
    draws = 60_000
    for temperature in (0.5, 2.0):
        ids = cpu_kernels.sample_race(logits.expand(draws, 3).contiguous(), torch.full((draws,), temperature),
                                      torch.arange(draws) * 7)  # fmt: skip
        assert ids is not None
        frequencies = torch.bincount(ids, minlength=3).double() / draws
        expected = (logits.double() / temperature).softmax(dim=-1)
        assert ((frequencies - expected).abs() <= 4 * (expected * (1 - expected) / draws).sqrt()).all()


def test_strided_rows_edge_values_and_what_it_declines():
    wide = torch.full((4, 12), float("-inf"))
    logits = wide[:, 1:11]  # strided rows
    logits[0, 3] = 0.0  # the one token left
    logits[1, 9] = 5.0  # in the last position
    logits[2] = 0.1
    logits[3, 2] = float("nan")  # a broken row still gets an index
    ones = torch.ones(4)
    ids = cpu_kernels.sample_race(logits, ones, torch.tensor([5, 6, 7, 8]))
    assert ids is not None
    assert ids[0] == 3 and ids[1] == 9 and 0 <= ids[2] < 10 and 0 <= ids[3] < 10
    assert cpu_kernels.sample_race(logits.double(), ones, torch.zeros(4, dtype=torch.int64)) is None
    assert cpu_kernels.sample_race(logits.t(), torch.ones(10), torch.zeros(10, dtype=torch.int64)) is None


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


@pytest.mark.parametrize("vocab", [50, 7168, 128256])
@pytest.mark.parametrize("scale", [0.3, 3.0, 12.0])  # flat to peaked rows
def test_top_k_top_p_filter_matches_the_sorting_filters(vocab, scale):
    """The native filter keeps what apply_top_k then apply_top_p keep, computed in float64 (their float32
    cumsum drifts over a long tail: it dropped 11 of 34k tokens of a top_p=0.99 row of 128k)."""
    gen = torch.Generator().manual_seed(vocab + int(scale * 10))
    logits = torch.randn(16, vocab, generator=gen) * scale
    logits[3, : vocab // 2] = float("-inf")  # already removed tokens (a grammar, an earlier filter)
    top_k = torch.tensor([0, 1, 5, 50, 0, 0, 7, vocab, vocab - 1, 3, 0, 100, 0, 2, 0, 40])
    top_p = torch.tensor([0.9, 1.0, 0.5, 0.95, 0.1, 0.99, 1.0, 0.8, 0.3, 0.999, 1.0, 0.7, 1e-4, 1.0, 0.6, 0.9])
    reference = apply_top_p(apply_top_k(logits.double(), top_k), top_p.double())
    filtered = logits.clone()
    assert cpu_kernels.filter_logits_(filtered, top_k, top_p, torch.zeros(16))
    assert torch.equal(torch.isinf(filtered), torch.isinf(reference))
    kept = torch.isfinite(filtered)
    assert torch.equal(filtered[kept], logits[kept])  # kept logits untouched


@pytest.mark.parametrize("vocab", [50, 7168])
def test_min_p_with_and_without_the_other_filters_matches_apply_min_p(vocab):
    gen = torch.Generator().manual_seed(vocab)
    logits = torch.randn(6, vocab, generator=gen) * 3
    top_k = torch.tensor([0, 0, 10, 0, 3, 0])
    top_p = torch.tensor([1.0, 1.0, 1.0, 0.9, 0.8, 1.0])
    min_p = torch.tensor([0.1, 0.0, 0.05, 0.3, 0.01, 1.0])
    reference = apply_min_p(apply_top_p(apply_top_k(logits.double(), top_k), top_p.double()), min_p.double())
    filtered = logits.clone()
    assert cpu_kernels.filter_logits_(filtered, top_k, top_p, min_p)
    assert torch.equal(torch.isinf(filtered), torch.isinf(reference))
    assert torch.equal(filtered[1], logits[1])  # nothing asked


def test_top_k_top_p_filter_ties_strides_and_what_it_declines():
    wide = torch.zeros(4, 12)
    logits = wide[:, 1:11]  # strided rows
    logits[0] = torch.tensor([1.0, 5.0, 3.0, 5.0, 2.0, 3.0, 0.0, 3.0, -1.0, 4.0])
    logits[1] = logits[0]
    logits[2] = float("nan")  # left as it is
    logits[3] = logits[0]
    top_k = torch.tensor([3, 0, 2, 0])
    top_p = torch.tensor([1.0, 0.3, 0.5, 1.0])  # row 3: nothing to do
    before = logits.clone()
    assert cpu_kernels.filter_logits_(logits, top_k, top_p, torch.zeros(4))
    finite = torch.isfinite(logits)
    assert finite[0].nonzero().flatten().tolist() == [1, 3, 9]  # the two 5s and the 4 (k = 3)
    assert finite[1].nonzero().flatten().tolist() == [1, 3]  # one 5 holds 0.35 >= 0.3: its tie is kept too
    assert logits[2].isnan().all() and torch.equal(logits[3], before[3])
    assert not cpu_kernels.filter_logits_(logits.double(), top_k, top_p, torch.zeros(4))
    assert not cpu_kernels.filter_logits_(
        logits.t(), torch.zeros(10, dtype=torch.int64), torch.ones(10), torch.zeros(10)
    )


def test_penalties_match_the_count_tensors_bit_for_bit():
    """The native penalties give the same bits as apply_repetition_penalty then
    apply_frequency_presence_penalties over [rows, n] count tensors, row by row whatever its mix."""
    vocab, rows = 3000, 7
    gen = torch.Generator().manual_seed(11)
    logits = torch.randn(rows, vocab, generator=gen) * 4
    prompts = [torch.randint(0, vocab, (int(n),), generator=gen).tolist() for n in (0, 5, 300, 40, 2, 0, 17)]
    outputs = [torch.randint(0, 60, (int(n),), generator=gen).tolist() for n in (9, 0, 200, 33, 4, 1, 0)]
    outputs[3] += prompts[3][:5]  # tokens in both
    prompts[4] += [vocab + 5, -1]  # outside the vocabulary: skipped
    repetition = torch.tensor([1.0, 1.3, 1.1, 0.8, 2.0, 1.0, 1.5])
    frequency = torch.tensor([0.5, 0.0, 0.2, -0.4, 0.0, 1.5, 0.3])
    presence = torch.tensor([0.0, 0.0, 0.7, 0.25, 1.0, -0.5, 0.0])
    in_vocab = [[t for t in p if 0 <= t < vocab] for p in prompts]
    prompt_seen = torch.zeros(rows, vocab, dtype=torch.bool)
    counts = torch.zeros(rows, vocab)
    for r in range(rows):
        prompt_seen[r, in_vocab[r]] = True
        for t in outputs[r]:
            counts[r, t] += 1
    reference = apply_repetition_penalty(logits, prompt_seen | (counts > 0), repetition)
    reference = apply_frequency_presence_penalties(reference, counts, frequency, presence)
    penalised = logits.clone()
    assert cpu_kernels.apply_penalties_(penalised, prompts, outputs, repetition, frequency, presence)
    assert torch.equal(penalised, reference)
    assert not cpu_kernels.apply_penalties_(logits.double(), prompts, outputs, repetition, frequency, presence)


@pytest.mark.parametrize("vocab", [7, 7168, 128256])
def test_logprobs_match_log_softmax_and_topk(vocab):
    gen = torch.Generator().manual_seed(vocab)
    logits = torch.randn(5, vocab, generator=gen) * 3
    logits[1, : vocab // 2] = float("-inf")  # removed tokens
    logits[2, :3] = 50.0  # ties at the top: the lower id first
    token_ids = torch.randint(0, vocab, (5,), generator=gen)
    num_top = min(5, vocab)
    got = cpu_kernels.logprobs(logits, token_ids, num_top)
    assert got is not None
    chosen, top_ids, top_logprobs = got
    reference = torch.log_softmax(logits.double(), dim=-1)
    assert torch.allclose(chosen.double(), reference.gather(1, token_ids.unsqueeze(1)).squeeze(1), atol=1e-4)
    for r in range(5):
        order = torch.sort(logits[r], descending=True, stable=True).indices[:num_top]  # ties: lower id first
        assert torch.equal(top_ids[r], order)
        assert torch.allclose(top_logprobs[r].double(), reference[r, order], atol=1e-4)
    empty = cpu_kernels.logprobs(logits, token_ids, 0)
    assert empty is not None and empty[1].shape == (5, 0)
    assert (
        cpu_kernels.logprobs(logits, token_ids, 65) is None
        and cpu_kernels.logprobs(logits.double(), token_ids, 1) is None
    )


@pytest.mark.parametrize("vocab", [7, 7168, 128256])
def test_prompt_logprobs_rank_counts_the_larger_logits(vocab):
    """The rank is 1 + the tokens with a strictly larger logit (ties share the better rank), compared on the
    logits themselves; logprobs and top tokens as ``logprobs`` gives them."""
    gen = torch.Generator().manual_seed(vocab + 1)
    logits = torch.randn(6, vocab, generator=gen) * 3
    logits[1, : vocab // 2] = float("-inf")
    token_ids = torch.randint(0, vocab, (6,), generator=gen)
    logits[2, :] = logits[2, token_ids[2]]  # every token tied with the target: rank 1
    token_ids[3] = int(logits[3].argmax())  # the most likely token: rank 1
    token_ids[4] = int(logits[4].argmin())  # the least likely: rank vocab (no ties among random floats)
    num_top = min(3, vocab)
    got = cpu_kernels.prompt_logprobs(logits, token_ids, num_top)
    assert got is not None
    chosen, ranks, top_ids, top_logprobs = got
    expected = (logits.double() > logits.double().gather(1, token_ids.unsqueeze(1))).sum(dim=-1) + 1
    assert torch.equal(ranks, expected)
    assert ranks[2] == 1 and ranks[3] == 1 and ranks[4] == vocab
    plain = cpu_kernels.logprobs(logits, token_ids, num_top)
    assert plain is not None
    assert torch.equal(chosen, plain[0]) and torch.equal(top_ids, plain[1]) and torch.equal(top_logprobs, plain[2])
