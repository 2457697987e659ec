"""The benchmark checkpoint writer produces a checkpoint the engine and transformers load alike."""

from __future__ import annotations

import torch

from shared.bench.make_checkpoint import main
from shared.engine import LLM, SamplingParams


def test_tiny_shape_loads_and_matches_transformers(tmp_path):
    from transformers import AutoModelForCausalLM

    out = tmp_path / "ckpt"
    assert main([str(out), "--shape", "tiny-llama", "--dtype", "float32", "--device", "cpu"]) == 0
    llm = LLM(model=str(out), dtype="float32", num_blocks=32)
    prompt = [5, 900, 77, 8000, 31]  # ids beyond the demo tokenizer's vocabulary are fine without detokenizing
    params = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True, detokenize=False)
    got = llm.generate([prompt], params)[0].outputs[0].token_ids
    hf = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    with torch.inference_mode():
        ref = hf.generate(torch.tensor([prompt]), max_new_tokens=5, do_sample=False, eos_token_id=None, pad_token_id=0)
    assert got == ref[0, len(prompt) :].tolist()
