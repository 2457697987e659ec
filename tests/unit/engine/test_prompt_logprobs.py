"""Prompt logprobs equal transformers' log_softmax of the prompt's logits, chunked or not, cached or not."""

from __future__ import annotations

import pytest
import torch

from shared.engine import LLM, SamplingParams
from shared.engine.sampling_params import InvalidRequestError

PROMPT = [3, 17, 29, 101, 7, 55, 13, 88, 21, 5, 64, 40, 9, 31, 77, 2, 19, 45, 60, 11, 8, 99, 23]


def hf_prompt_logprobs(model_dir, prompt: list[int]) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.inference_mode():
        logits = model(torch.tensor([prompt])).logits[0]  # [P, V]
    return logits.float().log_softmax(dim=-1)  # [P, V]


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_prompt_logprobs_match_hf_with_chunks_and_a_warm_prefix_cache(checkpoint_factory, arch):
    model_dir = checkpoint_factory(arch)
    reference = hf_prompt_logprobs(model_dir, PROMPT)  # [P, V]
    llm = LLM(model=str(model_dir), dtype="float32", block_size=4, num_blocks=64, max_num_batched_tokens=8)
    plain = SamplingParams(temperature=0, max_tokens=2)
    llm.generate([PROMPT], plain)  # warms the prefix cache: a scored request must not use it
    params = SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=3)
    [out] = llm.generate([PROMPT], params)
    scored = out.prompt_logprobs
    assert scored is not None and len(scored) == len(PROMPT) and scored[0] is None
    assert out.num_cached_tokens == 0
    for position in range(1, len(PROMPT)):
        entry = scored[position]
        assert entry is not None
        row = reference[position - 1]  # [V]
        token = PROMPT[position]
        assert entry[token] == pytest.approx(row[token].item(), abs=1e-4)
        top_values, top_ids = row.topk(3)
        for token_id, value in zip(top_ids.tolist(), top_values.tolist(), strict=True):
            assert entry[token_id] == pytest.approx(value, abs=1e-4)
    # The same request without prompt logprobs still gets its cache hit.
    [again] = llm.generate([PROMPT], plain)
    assert again.num_cached_tokens > 0 and again.prompt_logprobs is None


def test_ranks_and_bounds(checkpoint_factory):
    from shared.engine.prompt_logprobs import score_prompt

    logits = torch.tensor([[0.0, 2.0, 1.0], [5.0, 1.0, 3.0]])
    lp, rank, top_ids, _ = score_prompt(logits, torch.tensor([2, 0]), 1)
    assert rank.tolist() == [2, 1] and top_ids.tolist() == [[1], [0]]
    assert lp[1].item() == pytest.approx(logits[1].log_softmax(-1)[0].item())
    with pytest.raises(InvalidRequestError, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=21)
