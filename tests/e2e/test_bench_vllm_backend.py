"""``cleave bench throughput --backend vllm``: the child-process plumbing and the output digest.

vLLM itself cannot be installed in the test environment, so the "vLLM python"
here is the test interpreter with a stand-in ``vllm`` package on its path whose
``LLM`` generates with Cleave's engine; the stand-in is the only fake. The real
comparison is a command run by hand (see README).
"""

from __future__ import annotations

import json
import stat
import sys

import pytest

from tests.e2e.test_cli import cleave, expected_output_tokens
from tests.integration.cluster import ROOT

FAKE_VLLM = """
import os

from shared.engine import LLM as _LLM, SamplingParams as _SamplingParams


class SamplingParams:
    def __init__(self, temperature, max_tokens, ignore_eos=False, detokenize=True):
        assert temperature == 0.0 and not detokenize
        self.params = _SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=ignore_eos, detokenize=False)


class LLM:
    def __init__(self, model, dtype, max_num_batched_tokens, max_num_seqs, enable_prefix_caching, max_model_len,
                 kv_cache_dtype, skip_tokenizer_init, seed):
        assert kv_cache_dtype in ("auto", "bfloat16", "fp8", "fp8_e4m3", "fp8_e5m2")  # vLLM's names
        self.llm = _LLM(model=model, dtype=dtype, kv_cache_memory=16 << 20, max_num_seqs=max_num_seqs,
                        max_num_batched_tokens=max_num_batched_tokens, kv_cache_dtype=kv_cache_dtype)

    def generate(self, prompts, params, use_tqdm):
        with open(os.environ["FAKE_VLLM_CALLS"], "a") as f:  # the test reads how many prompts each call had
            f.write(f"{len(prompts)}\\n")
        return self.llm.generate([p["prompt_token_ids"] for p in prompts], [p.params for p in params])
"""


# float32 reaches vLLM as its "auto"; warm-up rounds run other prompts first and leave the timed tokens alone
@pytest.mark.parametrize("kv_cache_dtype,warmup_rounds", [("float32", 0), ("fp8", 2)])
def test_vllm_backend_reports_the_same_digest_as_cleave(checkpoint_factory, tmp_path, kv_cache_dtype, warmup_rounds):
    fake = tmp_path / "site" / "vllm"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text(FAKE_VLLM)
    (fake / "inputs.py").write_text(
        "def TokensPrompt(prompt_token_ids):\n    return {'prompt_token_ids': prompt_token_ids}\n"
    )
    python = tmp_path / "vllm-python"
    calls = tmp_path / "calls"
    python.write_text(
        f'#!/bin/sh\nFAKE_VLLM_CALLS={calls} PYTHONPATH={fake.parent}:{ROOT} exec {sys.executable} "$@"\n'
    )
    python.chmod(python.stat().st_mode | stat.S_IEXEC)
    model_dir = str(checkpoint_factory("llama"))
    common = ["bench", "throughput", "--model", model_dir, "--num-prompts", "6", "--prompt-len", "8", "24",
              "--output-len", "4", "12", "--dtype", "float32", "--kv-cache-memory", "16MiB",
              "--kv-cache-dtype", kv_cache_dtype, "--warmup-rounds", str(warmup_rounds)]  # fmt: skip
    reports = {}
    for backend in ("cleave", "vllm"):
        done = cleave(*common, "--backend", backend, "--vllm-python", str(python))
        assert done.returncode == 0, done.stderr[-2000:]
        reports[backend] = json.loads(done.stdout)
    assert reports["vllm"]["backend"] == "vllm"
    assert reports["vllm"]["output_tokens"] == reports["cleave"]["output_tokens"] == expected_output_tokens(model_dir)
    assert len(reports["cleave"]["output_digest"]) == 16
    assert reports["vllm"]["output_digest"] == reports["cleave"]["output_digest"]
    # vLLM's child: one prompt that builds its kernels, each warm-up round's 6, then the timed 6
    assert calls.read_text().split() == ["1", *["6"] * warmup_rounds, "6"]


def test_vllm_backend_needs_its_python(checkpoint_factory):
    done = cleave("bench", "throughput", "--model", str(checkpoint_factory("llama")), "--backend", "vllm",
                  "--num-prompts", "2")  # fmt: skip
    assert done.returncode != 0 and "--vllm-python" in done.stderr
    assert done.stdout == ""
