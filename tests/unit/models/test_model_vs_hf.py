"""Our paged Llama-family model reproduces Hugging Face logits on tiny random checkpoints."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from shared.kernels.torch_ref import TorchAttentionBackend
from shared.models.config import load_model_config
from shared.models.loader import load_model
from tests.helpers.checkpoints import ARCHES
from tests.helpers.paged import PagedSequences

BLOCK_SIZE = 4
PROMPT_LEN = 11
NUM_DECODE = 5


def random_tokens(n: int, vocab_size: int, seed: int) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(4, vocab_size, (n,), generator=gen).tolist()


@torch.no_grad()
def hf_logits(model_dir, tokens: list[int], dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Logits for every position of ``tokens`` in one uncached HF forward: [len, vocab] float32."""
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).eval()
    return hf(torch.tensor([tokens])).logits[0].float()


def run_whole_then_chunked(model_dir, dtype: str = "auto") -> tuple[list[torch.Tensor], torch.Tensor]:
    """Our logits for (a) whole prompt, (b) 3-token chunks, (c) decode steps, and HF's over all tokens."""
    model, config = load_model(model_dir, dtype=dtype)
    tokens = random_tokens(PROMPT_LEN + NUM_DECODE, config.vocab_size, seed=1)
    prompt, decode = tokens[:PROMPT_LEN], tokens[PROMPT_LEN:]
    backend = TorchAttentionBackend()

    whole = PagedSequences(model, backend, BLOCK_SIZE, max_len=len(tokens), seed=2).step({0: prompt})[0]

    paged = PagedSequences(model, backend, BLOCK_SIZE, max_len=len(tokens), seed=3)
    chunked = torch.cat([paged.step({0: prompt[i : i + 3]})[0] for i in range(0, PROMPT_LEN, 3)])
    decoded = torch.cat([paged.step({0: [t]})[0] for t in decode])
    return [whole, chunked, decoded], tokens


@pytest.mark.parametrize("arch", ARCHES)
def test_logits_match_hf_whole_chunked_and_decode(checkpoint_factory, arch):
    model_dir = checkpoint_factory(arch)
    (whole, chunked, decoded), tokens = run_whole_then_chunked(model_dir)
    ref = hf_logits(model_dir, tokens)  # [16, vocab]
    torch.testing.assert_close(whole, ref[:PROMPT_LEN], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(chunked, ref[:PROMPT_LEN], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(decoded, ref[PROMPT_LEN:], atol=1e-4, rtol=1e-4)


def test_mixed_batch_of_prefill_chunk_and_decode_matches_hf(checkpoint_factory):
    """Three sequences in one step: a whole prompt, a middle chunk and a decode token."""
    model_dir = checkpoint_factory("qwen3")
    model, config = load_model(model_dir)
    seqs = [random_tokens(n, config.vocab_size, seed=10 + n) for n in (9, 12, 7)]
    paged = PagedSequences(model, TorchAttentionBackend(), BLOCK_SIZE, max_len=16, num_seqs=3, seed=4)
    paged.step({1: seqs[1][:5], 2: seqs[2][:6]})
    out = paged.step({0: seqs[0], 1: seqs[1][5:], 2: seqs[2][6:]})
    for i, tokens in enumerate(seqs):
        ref = hf_logits(model_dir, tokens)
        torch.testing.assert_close(out[i], ref[-len(out[i]) :], atol=1e-4, rtol=1e-4)


def test_bfloat16_logits_close_to_hf(checkpoint_factory):
    model_dir = checkpoint_factory("llama3", dtype="bfloat16")
    assert load_model_config(model_dir).torch_dtype == "bfloat16"
    (whole, chunked, decoded), tokens = run_whole_then_chunked(model_dir)  # auto -> bfloat16
    ref = hf_logits(model_dir, tokens, dtype=torch.bfloat16)
    ours = torch.cat([chunked, decoded])
    torch.testing.assert_close(whole, ref[:PROMPT_LEN], atol=0.1, rtol=0.05)
    torch.testing.assert_close(ours, ref, atol=0.1, rtol=0.05)
    # Greedy choices agree wherever HF's top two logits are not near-tied.
    top2 = ref.topk(2, dim=-1).values
    clear = (top2[:, 0] - top2[:, 1]) > 0.1
    assert torch.equal(ours.argmax(-1)[clear], ref.argmax(-1)[clear])


@pytest.mark.parametrize("arch", ["llama3", "qwen2"])
def test_top_level_rope_layout_loads_and_matches_hf(checkpoint_factory, arch):
    nested_dir = checkpoint_factory(arch)
    top_dir = checkpoint_factory(arch, rope_layout="toplevel")
    nested, top = load_model_config(nested_dir), load_model_config(top_dir)
    assert top.rope_theta == nested.rope_theta == 10000.0
    if arch == "llama3":
        # The nested layout also carries rope_theta inside the scaling dict.
        assert top.rope_scaling == {k: v for k, v in nested.rope_scaling.items() if k != "rope_theta"}
        assert top.rope_scaling["rope_type"] == "llama3"
    else:
        assert top.rope_scaling is None and nested.rope_scaling is None
    (whole, _, decoded), tokens = run_whole_then_chunked(top_dir)
    ref = hf_logits(top_dir, tokens)
    torch.testing.assert_close(whole, ref[:PROMPT_LEN], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(decoded, ref[PROMPT_LEN:], atol=1e-4, rtol=1e-4)
