"""Beam search against transformers' ``generate(num_beams=...)`` on random-weight checkpoints.

Beams share prompt and common-prefix blocks by reference count; the test also
checks the blocks a group holds stay far below ``beam_width`` independent copies.
"""

from __future__ import annotations

import pytest
import torch

from shared.engine import LLM, SamplingParams
from shared.engine.sampling_params import InvalidRequestError
from tests.unit.engine.test_engine_vs_hf import make_prompts

BLOCK_SIZE = 4


def hf_beam_search(
    model_dir, prompt, *, num_beams, num_return, max_tokens, length_penalty, early_stopping, stop_token_ids=()
):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    eos = model.generation_config.eos_token_id
    eos_ids = [*(eos if isinstance(eos, list) else [eos]), *stop_token_ids]
    with torch.inference_mode():
        ids = torch.tensor([prompt])
        # An explicit mask: pad_token_id may equal the prompt's BOS, which generate() would then mask out.
        out = model.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_tokens, do_sample=False, num_beams=num_beams,
            num_return_sequences=num_return, length_penalty=length_penalty, early_stopping=early_stopping,
            eos_token_id=eos_ids, pad_token_id=0,
        )  # fmt: skip
    results = []
    for row in out[:, len(prompt) :].tolist():
        cut = next((i + 1 for i, t in enumerate(row) if t in eos_ids), len(row))
        results.append(row[:cut])
    return results


def run_beam_search(llm, prompt, **kwargs):
    """Tokens of each returned beam and the most blocks the beams held at once."""
    engine = llm.engine
    peaks = []
    resolve = engine.beams.resolve

    def tracking_resolve():
        for group in engine.beams.groups.values():
            peaks.append(engine.beams.blocks_held(group))
        assert engine.ownership_problems() == []  # parked beams still own their blocks
        result = resolve()
        assert engine.ownership_problems() == []
        return result

    engine.beams.resolve = tracking_resolve
    try:
        [output] = llm.generate([prompt], SamplingParams(use_beam_search=True, **kwargs))
    finally:
        engine.beams.resolve = resolve
    return output, max(peaks)


@pytest.mark.parametrize(
    ("arch", "width", "n", "length_penalty", "early_stopping", "max_tokens", "stop_at_greedy_step"),
    [
        ("llama", 4, 4, 1.0, False, 12, None),
        ("llama", 4, 3, 0.0, False, 12, 1),  # a stop id that the greedy path reaches: beams finish early
        ("qwen2", 3, 2, 0.5, True, 10, 1),
        ("qwen3", 4, 1, 1.5, "never", 9, None),
    ],
)
def test_beam_search_matches_hf_and_shares_blocks(
    checkpoint_factory, arch, width, n, length_penalty, early_stopping, max_tokens, stop_at_greedy_step
):
    model_dir = checkpoint_factory(arch)
    llm = LLM(model=str(model_dir), block_size=BLOCK_SIZE, num_blocks=256, dtype="float32")
    cfg = llm.engine.model_config
    prompt = make_prompts(cfg.vocab_size, set(cfg.eos_token_ids) | {cfg.bos_token_id}, count=1, seed=3)[0]
    stop_ids = []
    if stop_at_greedy_step is not None:
        [greedy] = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True))
        stop_ids = [greedy.outputs[0].token_ids[stop_at_greedy_step]]
    output, peak_blocks = run_beam_search(
        llm, prompt, n=n, best_of=width, max_tokens=max_tokens, length_penalty=length_penalty,
        early_stopping=early_stopping, stop_token_ids=stop_ids,
    )  # fmt: skip
    expected = hf_beam_search(
        model_dir, prompt, num_beams=width, num_return=n, max_tokens=max_tokens,
        length_penalty=length_penalty, early_stopping=early_stopping, stop_token_ids=stop_ids,
    )  # fmt: skip
    assert [c.token_ids for c in output.outputs] == expected
    if stop_ids:
        assert any(c.finish_reason == "stop" for c in output.outputs)
    # Independent requests would each hold the whole prompt and their own tail.
    independent = width * -(-(len(prompt) + max_tokens) // BLOCK_SIZE)
    assert peak_blocks * 2 <= independent, (peak_blocks, independent)
    assert llm.engine.kv.num_free_blocks == llm.engine.kv.num_blocks  # nothing leaked
    assert not llm.engine.beams.groups


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"use_beam_search": True, "stop": ["x"]}, "stop"),
        ({"use_beam_search": True, "top_p": 0.5}, "top_p"),
        ({"use_beam_search": True, "temperature": 0.7}, "temperature"),
        ({"use_beam_search": True, "n": 3, "best_of": 2}, "best_of"),
        ({"use_beam_search": True, "best_of": 11}, "10 beams"),
        ({"best_of": 3}, "use_beam_search"),
        ({"length_penalty": 2.0}, "use_beam_search"),
        ({"use_beam_search": True, "early_stopping": "sometimes"}, "early_stopping"),
    ],
)
def test_beam_search_refuses_what_it_cannot_honour(kwargs, field):
    with pytest.raises(InvalidRequestError, match=field):
        SamplingParams(**kwargs)


@pytest.mark.parametrize("num_blocks", [256, 24])
def test_beam_search_alongside_other_requests_with_chunking_and_preemption(checkpoint_factory, num_blocks):
    model_dir = checkpoint_factory("llama")
    llm = LLM(
        model=str(model_dir), block_size=BLOCK_SIZE, num_blocks=num_blocks, max_num_batched_tokens=16,
        dtype="float32",
    )  # fmt: skip
    cfg = llm.engine.model_config
    prompts = make_prompts(cfg.vocab_size, set(cfg.eos_token_ids) | {cfg.bos_token_id}, count=3, seed=5)
    beam = SamplingParams(use_beam_search=True, n=2, best_of=3, max_tokens=8)
    greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    outputs = llm.generate(prompts, [beam, greedy, beam])
    [alone] = llm.generate([prompts[1]], greedy)
    assert outputs[1].outputs[0].token_ids == alone.outputs[0].token_ids
    for i in (0, 2):
        expected = hf_beam_search(
            model_dir, prompts[i], num_beams=3, num_return=2, max_tokens=8, length_penalty=1.0, early_stopping=False
        )
        assert [c.token_ids for c in outputs[i].outputs] == expected
    assert llm.engine.kv.num_free_blocks == llm.engine.kv.num_blocks
    if num_blocks < 32:
        assert llm.engine.scheduler.num_preemptions > 0  # the small pool did preempt a beam or a request
