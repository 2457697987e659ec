"""allowed_token_ids, bad words and logit_bias: the batched logits step, and the engine using it."""

from __future__ import annotations

import pytest
import torch

from shared.engine import LLM, SamplingParams
from shared.engine.sampling_params import InvalidRequestError
from shared.engine.token_constraints import apply_token_constraints, build_token_constraints

VOCAB = 8
NEG_INF = float("-inf")


def step(params: list[SamplingParams], outputs: list[list[int]], logits: torch.Tensor) -> torch.Tensor:
    constraints = build_token_constraints(params, outputs, VOCAB, "cpu")
    return logits if constraints is None else apply_token_constraints(logits, constraints)


def test_rows_without_controls_cost_nothing():
    assert build_token_constraints([SamplingParams(), SamplingParams()], [[], []], VOCAB, "cpu") is None


def test_each_row_gets_only_its_own_controls():
    logits = torch.zeros(4, VOCAB)
    params = [
        SamplingParams(allowed_token_ids=[1, 3]),
        SamplingParams(logit_bias={2: 5.0, 4: -100.0}),
        SamplingParams(bad_words_token_ids=[[6], [1, 5], [2, 7]]),
        SamplingParams(),
    ]
    out = step(params, [[], [], [0, 1], []], logits)
    expected = torch.zeros(4, VOCAB)
    expected[0] = NEG_INF
    expected[0, [1, 3]] = 0.0
    expected[1, 2], expected[1, 4] = 5.0, -100.0
    expected[2, [6, 5]] = NEG_INF  # [6] always; [1, 5] because the output ends with 1; not [2, 7]
    assert torch.equal(out, expected)
    assert torch.equal(logits, torch.zeros(4, VOCAB)), "the input logits were modified"


def test_bias_adds_to_the_logit_and_ids_past_the_vocabulary_are_skipped():
    logits = torch.arange(VOCAB, dtype=torch.float32).repeat(1, 1)
    out = step([SamplingParams(logit_bias={0: 2.5, 50: 1.0}, allowed_token_ids=[0, 1, 60])], [[]], logits)
    assert out[0, :2].tolist() == [2.5, 1.0] and torch.isinf(out[0, 2:]).all()


@pytest.mark.parametrize(
    "kwargs, contains",
    [
        ({"logit_bias": {3: 100.5}}, "[-100, 100]"),
        ({"logit_bias": {-1: 1.0}}, "logit_bias keys"),
        ({"allowed_token_ids": []}, "allowed_token_ids"),
        ({"bad_words_token_ids": [[]]}, "bad_words"),
    ],
)
def test_invalid_controls_are_refused(kwargs, contains):
    with pytest.raises(InvalidRequestError, match=contains.replace("[", r"\[").replace("]", r"\]")):
        SamplingParams(**kwargs)


@pytest.fixture(scope="module")
def llm(checkpoint_factory) -> LLM:
    return LLM(model=str(checkpoint_factory("llama")), dtype="float32", block_size=4, num_blocks=64)


def greedy(llm: LLM, prompt: list[int], **kwargs) -> list[int]:
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, **kwargs)
    return llm.generate([prompt], params)[0].outputs[0].token_ids


def test_engine_logit_bias_forces_and_bans_in_one_batch(llm):
    prompt = [5, 9, 13, 17]
    plain = greedy(llm, prompt)
    assert greedy(llm, prompt, logit_bias={42: 100.0}) == [42] * 6
    banned = greedy(llm, prompt, logit_bias={plain[0]: -100.0})
    assert banned[0] != plain[0]
    # Rows with and without controls share a step: each keeps its own answer.
    params = [
        SamplingParams(temperature=0, max_tokens=6, ignore_eos=True),
        SamplingParams(temperature=0.8, seed=3, max_tokens=6, ignore_eos=True, allowed_token_ids=[7, 8]),
    ]
    first, second = (o.outputs[0].token_ids for o in llm.generate([prompt, prompt], params))
    assert first == plain and set(second) <= {7, 8}


def test_engine_bad_words_never_completes_the_word(llm):
    prompt = [5, 9, 13, 17]
    plain = greedy(llm, prompt)
    word = plain[1:3]  # the greedy output contains it at position 1
    out = greedy(llm, prompt, bad_words_token_ids=[word])
    assert all(out[i : i + 2] != word for i in range(len(out) - 1)), out
    assert out[:2] == plain[:2]
