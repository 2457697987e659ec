"""Sampler tests: every filter and penalty against a plain Python reference."""

from __future__ import annotations

import math

import pytest
import torch

from shared.engine.sampler import (
    Sampler,
    SamplingBatch,
    apply_min_p,
    apply_min_tokens_and_penalties,
    apply_top_k,
    apply_top_p,
    make_generator,
)
from shared.engine.sampling_params import SamplingParams

VOCAB_SIZE = 12
EOS_ID = 11


def build(
    params: list[SamplingParams],
    prompts: list[list[int]] | None = None,
    outputs: list[list[int]] | None = None,
    generators: list[torch.Generator | None] | None = None,
    vocab_size: int = VOCAB_SIZE,
) -> SamplingBatch:
    num_rows = len(params)
    return SamplingBatch.build(
        params,
        prompt_token_ids=prompts or [[0]] * num_rows,
        output_token_ids=outputs or [[]] * num_rows,
        generators=generators or [make_generator(p.seed, "cpu") for p in params],
        eos_token_ids=[EOS_ID],
        vocab_size=vocab_size,
        device="cpu",
    )


def random_logits(num_rows: int, seed: int, vocab_size: int = VOCAB_SIZE, scale: float = 1.5) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(num_rows, vocab_size, generator=generator) * scale  # [B, V]


def allowed_set(row: list[float], top_k: int = 0, top_p: float = 1.0, min_p: float = 0.0) -> set[int]:
    """Reference filter chain on one row of (already tempered) logits, in plain Python."""
    allowed = set(range(len(row)))
    if top_k > 0:
        kth_value = sorted(row, reverse=True)[min(top_k, len(row)) - 1]
        allowed = {i for i in allowed if row[i] >= kth_value}

    def probs() -> dict[int, float]:
        total = sum(math.exp(row[i]) for i in allowed)
        return {i: math.exp(row[i]) / total for i in allowed}

    if top_p < 1.0:
        kept, mass = set(), 0.0
        for token, prob in sorted(probs().items(), key=lambda item: -item[1]):
            if mass >= top_p:
                break
            kept.add(token)
            mass += prob
        allowed = kept
    if min_p > 0.0:
        current = probs()
        allowed = {i for i, prob in current.items() if prob >= min_p * max(current.values())}
    return allowed


def finite_ids(masked_row: torch.Tensor) -> set[int]:
    return set(torch.isfinite(masked_row).nonzero().flatten().tolist())


def test_make_generator() -> None:
    assert make_generator(None, "cpu") is None
    first, second = make_generator(7, "cpu"), make_generator(7, "cpu")
    assert first is not None and second is not None
    assert torch.equal(torch.rand(4, generator=first), torch.rand(4, generator=second))


def test_default_params_skip_optional_work() -> None:
    batch = build([SamplingParams(), SamplingParams(temperature=0.0)])
    assert not (batch.any_penalties or batch.any_top_k or batch.any_top_p or batch.any_min_p)
    assert batch.output_token_counts is None and batch.seen_token_mask is None
    assert batch.min_tokens_rows is None and batch.max_num_logprobs is None
    assert batch.any_greedy and not batch.all_greedy


def test_greedy_equals_argmax_with_ties_to_lowest_id() -> None:
    logits = random_logits(4, seed=0)
    logits[3] = 0.0
    logits[3, 5] = logits[3, 9] = 2.0
    out = Sampler()(logits, build([SamplingParams(temperature=0.0)] * 4))
    assert out.token_ids.tolist() == logits.argmax(dim=-1).tolist()
    assert out.token_ids[3].item() == 5


def test_mixed_greedy_and_random_rows() -> None:
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=1.0), SamplingParams(temperature=0.0)]
    batch = build(params)
    logits = torch.zeros(3, VOCAB_SIZE)  # [3, V] flat rows: random draws should vary
    logits[0, 4] = logits[2, 7] = 1.0
    torch.manual_seed(0)
    random_tokens = set()
    for _ in range(50):
        token_ids = Sampler()(logits, batch).token_ids.tolist()
        assert token_ids[0] == 4 and token_ids[2] == 7
        random_tokens.add(token_ids[1])
    assert len(random_tokens) > 5


def run_seeded(seed: int, rows_before: list[SamplingParams], rows_after: list[SamplingParams]) -> list[int]:
    """Tokens of one seeded row over several steps, with other rows around it."""
    params = [*rows_before, SamplingParams(temperature=0.8, top_p=0.95, seed=seed), *rows_after]
    generators = [make_generator(p.seed, "cpu") for p in params]
    target_row = len(rows_before)
    tokens = []
    for step in range(8):
        logits = random_logits(len(params), seed=100 + step)
        logits[target_row] = random_logits(1, seed=step)[0]  # the seeded row sees the same logits everywhere
        batch = build(params, generators=generators)
        tokens.append(Sampler()(logits, batch).token_ids[target_row].item())
    return tokens


def test_seeded_sampling_is_reproducible() -> None:
    assert run_seeded(1234, [], []) == run_seeded(1234, [], [])
    assert run_seeded(1234, [], []) != run_seeded(4321, [], [])


def test_seeded_sampling_is_independent_of_batch_composition() -> None:
    alone = run_seeded(1234, [], [])
    others_before = [SamplingParams(temperature=1.0), SamplingParams(temperature=0.0), SamplingParams(seed=9)]
    others_after = [SamplingParams(top_k=3), SamplingParams(temperature=0.5, min_p=0.1, seed=5)]
    torch.manual_seed(99)
    assert run_seeded(1234, others_before, others_after) == alone
    assert run_seeded(1234, others_after, []) == alone


FILTER_CASES = [
    dict(top_k=1),
    dict(top_k=3),
    dict(top_k=50),
    dict(top_p=0.5),
    dict(top_p=0.9),
    dict(min_p=0.2),
    dict(min_p=1.0),
    dict(top_k=5, top_p=0.7),
    dict(top_k=6, top_p=0.9, min_p=0.3),
]


@pytest.mark.parametrize("case", FILTER_CASES)
def test_masking_functions_match_reference(case: dict) -> None:
    logits = random_logits(6, seed=3)
    num_rows = logits.shape[0]
    masked = logits
    if case.get("top_k"):
        masked = apply_top_k(masked, torch.tensor([case["top_k"]] * (num_rows - 1) + [0]))
    if "top_p" in case:
        masked = apply_top_p(masked, torch.tensor([case["top_p"]] * (num_rows - 1) + [1.0]))
    if "min_p" in case:
        masked = apply_min_p(masked, torch.tensor([case["min_p"]] * (num_rows - 1) + [0.0]))
    for row in range(num_rows - 1):
        assert finite_ids(masked[row]) == allowed_set(logits[row].tolist(), **case)
        kept = list(finite_ids(masked[row]))
        assert torch.equal(masked[row, kept], logits[row, kept])
    assert torch.equal(masked[-1], logits[-1])  # filters off for the last row


@pytest.mark.parametrize("case", FILTER_CASES)
def test_sampled_tokens_stay_in_reference_set(case: dict) -> None:
    temperature = 0.7
    logits = random_logits(1, seed=5).expand(3000, VOCAB_SIZE)  # [draws, V]
    batch = build([SamplingParams(temperature=temperature, **case)] * logits.shape[0])
    torch.manual_seed(1)
    drawn = set(Sampler()(logits, batch).token_ids.tolist())
    assert drawn == allowed_set((logits[0] / temperature).tolist(), **case)


def test_penalties_match_reference() -> None:
    params = [
        SamplingParams(repetition_penalty=1.3),
        SamplingParams(frequency_penalty=0.5, presence_penalty=0.25),
        SamplingParams(repetition_penalty=0.8, frequency_penalty=-0.3, presence_penalty=1.5),
        SamplingParams(),
    ]
    prompts = [[1, 2, 2], [3], [4, 5], [6]]
    outputs = [[7, 7, 1], [3, 8, 8, 8], [5, 9, 9], [7]]
    logits = random_logits(4, seed=11)
    processed = apply_min_tokens_and_penalties(logits, build(params, prompts, outputs))
    for row, p in enumerate(params):
        seen = set(prompts[row]) | set(outputs[row])
        for token in range(VOCAB_SIZE):
            expected = logits[row, token].item()
            if token in seen:
                expected = expected / p.repetition_penalty if expected > 0 else expected * p.repetition_penalty
            count = outputs[row].count(token)
            expected -= p.frequency_penalty * count + p.presence_penalty * (count > 0)
            assert processed[row, token].item() == pytest.approx(expected, abs=1e-5)


def test_min_tokens_suppresses_eos_and_stop_ids() -> None:
    params = [
        SamplingParams(temperature=0.0, min_tokens=3, stop_token_ids=[4]),
        SamplingParams(temperature=0.0, min_tokens=3, stop_token_ids=[4], ignore_eos=True),
        SamplingParams(temperature=0.0, min_tokens=2, stop_token_ids=[4]),
        SamplingParams(min_tokens=5, stop_token_ids=[4, 99]),  # 99 is outside the vocabulary
    ]
    outputs = [[1, 2], [1, 2], [1, 2], [3]]
    logits = torch.zeros(4, VOCAB_SIZE)
    logits[:, EOS_ID] = 50.0
    logits[:, 4] = 40.0
    batch = build(params, outputs=outputs)
    processed = apply_min_tokens_and_penalties(logits, batch)
    assert math.isinf(processed[0, EOS_ID]) and math.isinf(processed[0, 4])
    assert processed[1, EOS_ID] == 50.0 and math.isinf(processed[1, 4])
    assert torch.equal(processed[2], logits[2])  # already has min_tokens outputs
    torch.manual_seed(0)
    for _ in range(20):
        token_ids = Sampler()(logits, batch).token_ids.tolist()
        assert token_ids[0] not in (4, EOS_ID) and token_ids[1] == EOS_ID and token_ids[2] == EOS_ID
        assert token_ids[3] not in (4, EOS_ID)


def test_logprobs_match_log_softmax_with_per_row_k() -> None:
    params = [
        SamplingParams(temperature=0.0, logprobs=3),
        SamplingParams(temperature=0.5, top_k=2, logprobs=1, frequency_penalty=1.0),
        SamplingParams(temperature=1.0, logprobs=0),
        SamplingParams(temperature=1.0),
    ]
    outputs = [[], [0, 0], [5], []]
    logits = random_logits(4, seed=21)
    batch = build(params, outputs=outputs)
    torch.manual_seed(3)
    out = Sampler()(logits, batch)
    reference = torch.log_softmax(apply_min_tokens_and_penalties(logits, batch), dim=-1)  # [B, V]
    assert batch.max_num_logprobs == 3
    assert out.top_token_ids is not None and out.top_logprobs is not None
    assert out.top_token_ids.shape == out.top_logprobs.shape == (4, 3)
    for row, p in enumerate(params):
        token = out.token_ids[row].item()
        assert out.logprobs[row].item() == pytest.approx(reference[row, token].item(), abs=1e-5)
        expected_order = sorted(range(VOCAB_SIZE), key=lambda t: -reference[row, t].item())
        num_asked = p.logprobs or 0
        assert out.top_token_ids[row, :num_asked].tolist() == expected_order[:num_asked]
        for column in range(num_asked):
            expected = reference[row, expected_order[column]].item()
            assert out.top_logprobs[row, column].item() == pytest.approx(expected, abs=1e-5)
    assert reference[1, 0] < torch.log_softmax(logits[1], dim=-1)[0]  # penalty shows in logprobs


def test_no_logprobs_requested_gives_no_top_tensors() -> None:
    out = Sampler()(random_logits(2, seed=0), build([SamplingParams(temperature=0.0)] * 2))
    assert out.top_token_ids is None and out.top_logprobs is None
    assert out.logprobs.shape == (2,) and out.token_ids.dtype == torch.int64


@pytest.mark.parametrize("temperature", [1.0, 0.5])
def test_empirical_frequencies_match_softmax(temperature: float) -> None:
    num_draws = 20000
    row_logits = random_logits(1, seed=8, vocab_size=8)[0]  # [V]
    batch = build([SamplingParams(temperature=temperature)] * num_draws, vocab_size=8)
    torch.manual_seed(2024)
    token_ids = Sampler()(row_logits.expand(num_draws, 8), batch).token_ids
    frequencies = torch.bincount(token_ids, minlength=8).float() / num_draws
    expected = torch.softmax(row_logits / temperature, dim=-1)
    assert torch.allclose(frequencies, expected, atol=0.015)


def test_seeded_rows_follow_softmax() -> None:
    num_draws = 4000
    row_logits = random_logits(1, seed=8, vocab_size=6)[0]  # [V]
    params = [SamplingParams(seed=seed) for seed in range(num_draws)]
    token_ids = Sampler()(row_logits.expand(num_draws, 6), build(params, vocab_size=6)).token_ids
    frequencies = torch.bincount(token_ids, minlength=6).float() / num_draws
    assert torch.allclose(frequencies, torch.softmax(row_logits, dim=-1), atol=0.03)
