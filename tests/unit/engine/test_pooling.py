"""Embeddings from the engine equal a transformers forward pass pooled the same way."""

from __future__ import annotations

import pytest
import torch

from shared.engine import LLM, SamplingParams
from shared.engine.sampling_params import InvalidRequestError

PROMPTS = [[3, 17, 29, 101, 7, 55, 13, 88, 21, 5, 64, 40, 9, 31], [8, 99, 23, 4], [61] * 9]


def hf_pooled(model_dir, prompt: list[int], pooling: str, normalize: bool) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.inference_mode():
        hidden = model.model(torch.tensor([prompt])).last_hidden_state[0]  # [P, hidden], after the final norm
    pooled = hidden.mean(dim=0) if pooling == "mean" else hidden[-1]
    return torch.nn.functional.normalize(pooled, dim=0) if normalize else pooled


@pytest.mark.parametrize("pooling, normalize", [("last", True), ("mean", True), ("mean", False)])
def test_embeddings_match_hf_batched_and_chunked(checkpoint_factory, pooling, normalize):
    model_dir = checkpoint_factory("qwen2")
    llm = LLM(model=str(model_dir), dtype="float32", block_size=4, num_blocks=64, max_num_batched_tokens=8)
    llm.generate([PROMPTS[0]], SamplingParams(temperature=0, max_tokens=2))  # warm prefix cache
    params = SamplingParams(max_tokens=1, pooling=pooling, normalize=normalize)
    generate = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    outputs = llm.generate(PROMPTS + [PROMPTS[1]], [params] * len(PROMPTS) + [generate])
    for prompt, out in zip(PROMPTS, outputs, strict=False):
        assert out.embedding is not None
        expected = hf_pooled(model_dir, prompt, pooling, normalize)
        assert torch.allclose(torch.tensor(out.embedding), expected, atol=1e-4)
    assert outputs[-1].embedding is None and len(outputs[-1].outputs[0].token_ids) == 4


def test_embedding_requests_are_one_token():
    with pytest.raises(InvalidRequestError, match="pooling"):
        SamplingParams(pooling="max")
