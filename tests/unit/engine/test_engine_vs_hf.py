"""The engine against Hugging Face transformers, token for token, on random-weight checkpoints.

Small budgets force chunked prefill, prefix-cache hits and preemption; every
block must be free or evictable at the end.
"""

from __future__ import annotations

import random

import pytest
import torch

from shared.config import EngineConfig
from shared.engine import LLM, SamplingParams
from shared.engine.sampling_params import InvalidRequestError

ARCHS = ["llama", "llama3", "mistral", "qwen2", "qwen3"]
MAX_TOKENS = 10


def make_prompts(vocab_size: int, avoid: set[int], count: int = 18, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    allowed = [t for t in range(vocab_size) if t not in avoid]
    shared_prefix = [rng.choice(allowed) for _ in range(24)]
    prompts = []
    for i in range(count):
        tail = [rng.choice(allowed) for _ in range(rng.randint(1, 30))]
        prompts.append(shared_prefix + tail if i % 3 == 0 else tail + [rng.choice(allowed)])
    return prompts


def hf_greedy(model_dir, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    outputs = []
    with torch.inference_mode():
        for ids in prompts:
            out = model.generate(
                torch.tensor([ids]), max_new_tokens=max_tokens, min_new_tokens=max_tokens, do_sample=False,
                eos_token_id=None, pad_token_id=0,
            )  # fmt: skip
            outputs.append(out[0, len(ids) :].tolist())
    return outputs


def small_llm(model_dir, **kwargs) -> LLM:
    settings = dict(block_size=4, num_blocks=48, max_num_batched_tokens=40, max_num_seqs=16, dtype="float32")
    settings.update(kwargs)
    return LLM(model=str(model_dir), **settings)


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_matches_hf_with_chunking_prefix_hits_and_preemption(checkpoint_factory, arch):
    model_dir = checkpoint_factory(arch)
    llm = small_llm(model_dir)
    cfg = llm.engine.model_config
    prompts = make_prompts(cfg.vocab_size, set(cfg.eos_token_ids) | {cfg.bos_token_id})
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outputs = llm.generate(prompts, params)
    expected = hf_greedy(model_dir, prompts, MAX_TOKENS)
    for i, (out, ref) in enumerate(zip(outputs, expected, strict=True)):
        assert out.outputs[0].token_ids == ref, f"prompt {i} diverged from transformers"
        assert out.outputs[0].finish_reason == "length"
    stats = llm.engine.stats()
    assert stats.num_preemptions > 0, "the small KV budget should have forced preemption"
    assert stats.prefix_cache_hits > 0, "prompts sharing a 24-token prefix should hit the prefix cache"
    assert stats.num_free_blocks == stats.num_total_blocks, "blocks leaked"


def test_logits_match_hf(checkpoint_factory):
    from transformers import AutoModelForCausalLM

    model_dir = checkpoint_factory("qwen2")
    llm = small_llm(model_dir)
    prompt = make_prompts(llm.engine.model_config.vocab_size, set(), count=1, seed=3)[0]
    out = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=1, logprobs=5))[0].outputs[0]
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.inference_mode():
        logits = hf(torch.tensor([prompt])).logits[0, -1]
    ref = torch.log_softmax(logits.float(), -1)
    top = torch.topk(ref, 5)
    got = out.logprobs[0]
    assert list(got)[:1] == [int(top.indices[0])]
    for token_id, lp in zip(top.indices.tolist(), top.values.tolist(), strict=True):
        assert abs(got[token_id] - lp) < 1e-4


def test_prefix_hit_computes_only_uncached_tokens(checkpoint_factory):
    llm = small_llm(checkpoint_factory("llama"), num_blocks=64)
    prompt = list(range(10, 10 + 37))  # 9 full blocks of 4, then 1 token
    params = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    first = llm.generate([prompt], params)[0]
    before = llm.engine.stats().num_prompt_tokens_computed
    second = llm.generate([prompt[:36] + [99]], params)[0]
    computed = llm.engine.stats().num_prompt_tokens_computed - before
    assert second.num_cached_tokens == 36
    assert computed == 1  # only the uncached last token
    assert first.num_cached_tokens == 0


def test_n2_greedy_shares_prompt_blocks_and_matches(checkpoint_factory):
    llm = small_llm(checkpoint_factory("llama"))
    prompt = list(range(5, 23))  # 18 tokens: a partially filled last block is shared, then copied on write
    out = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=6, n=2, ignore_eos=True))[0]
    single = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True))[0]
    assert [c.token_ids for c in out.outputs] == [single.outputs[0].token_ids] * 2
    assert llm.engine.stats().num_free_blocks == llm.engine.num_blocks


def test_seeded_sampling_is_reproducible(checkpoint_factory):
    llm = small_llm(checkpoint_factory("llama"))
    params = SamplingParams(temperature=1.0, top_p=0.9, max_tokens=8, seed=123, n=2, ignore_eos=True)
    a = llm.generate(["hello there", "the cat"], params)
    b = llm.generate(["the cat"], params)
    assert [c.token_ids for c in a[1].outputs] == [c.token_ids for c in b[0].outputs]
    assert a[1].outputs[0].token_ids != a[1].outputs[1].token_ids  # children draw different noise


def test_stop_string_is_excluded_and_finishes(checkpoint_factory):
    llm = small_llm(checkpoint_factory("llama"))
    full = llm.generate(["the weather"], SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))[0]
    text = full.outputs[0].text
    stop = text[len(text) // 2 : len(text) // 2 + 2]
    assert stop
    out = llm.generate(["the weather"], SamplingParams(temperature=0.0, max_tokens=12, stop=[stop], ignore_eos=True))
    completion = out[0].outputs[0]
    assert completion.text == text[: text.index(stop)]
    assert completion.finish_reason == "stop"
    assert llm.engine.stats().num_free_blocks == llm.engine.num_blocks


def test_bad_inputs_are_refused_and_engine_keeps_serving(checkpoint_factory):
    llm = small_llm(checkpoint_factory("llama"))
    vocab = llm.engine.model_config.vocab_size
    cases = [
        ([[]], SamplingParams(), "empty"),
        ([list(range(1, 1000))], SamplingParams(), "maximum context length"),
        ([[1, 2, vocab + 5]], SamplingParams(), "outside the vocabulary"),
    ]
    for prompts, params, message in cases:
        with pytest.raises(InvalidRequestError, match=message):
            llm.generate(prompts, params)
    for kwargs in [{"max_tokens": 0}, {"temperature": -1}, {"top_p": 0}, {"top_k": -5}, {"min_p": 2}]:
        with pytest.raises(InvalidRequestError):
            SamplingParams(**kwargs)
    # A bad prompt in a batch rejects the batch before anything is queued.
    with pytest.raises(InvalidRequestError):
        llm.generate([[1, 2, 3], []], SamplingParams())
    assert not llm.engine.has_unfinished()
    out = llm.generate([[1, 2, 3]], SamplingParams(max_tokens=3, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 3


def test_abort_mid_generation_frees_blocks(checkpoint_factory):
    llm = small_llm(checkpoint_factory("llama"))
    core = llm.engine
    core.add_request("a", list(range(3, 30)), SamplingParams(max_tokens=50, ignore_eos=True))
    core.add_request("b", list(range(3, 20)), SamplingParams(max_tokens=50, ignore_eos=True, n=2))
    for _ in range(4):
        core.step()
    assert core.stats().num_free_blocks < core.num_blocks
    assert core.abort("a") and core.abort("b") and core.abort("b/1")
    assert not core.has_unfinished()
    assert core.stats().num_free_blocks == core.num_blocks


def test_stop_token_id_ends_output_and_is_not_in_text(checkpoint_factory):
    llm = small_llm(checkpoint_factory("llama"))
    full = llm.generate(["the garden"], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))[0].outputs[0]
    stop_id = full.token_ids[3]
    first = full.token_ids.index(stop_id)
    out = llm.generate(
        ["the garden"], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, stop_token_ids=[stop_id])
    )[0].outputs[0]
    assert out.token_ids == full.token_ids[: first + 1]
    assert out.finish_reason == "stop"
    assert out.text == llm.tokenizer.decode(full.token_ids[:first])


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "float32"])
@pytest.mark.parametrize("amx", [True, False])
def test_auto_dtype_on_cpu_runs_a_small_bfloat16_checkpoint_in_float32(checkpoint_factory, monkeypatch, amx,
                                                                        kv_cache_dtype):  # fmt: skip
    """The CPU's native kernels are float32: ``auto`` runs a bfloat16 checkpoint there in float32 (twice the
    speed), its projections on AMX or AVX512-BF16 where the CPU has them (their inputs rounded to bfloat16, as
    the checkpoint's dtype would), its KV cache in bfloat16 unless asked for float32. With neither nor a
    bfloat16 cache, greedy tokens equal transformers' on the checkpoint in float32; otherwise transformers'
    first token (in bfloat16 with AMX, else float32) is among ours' top 5, and ours among its."""
    from transformers import AutoModelForCausalLM

    from shared.kernels import cpu_kernels

    if amx and not cpu_kernels.amx():
        pytest.skip("neither AMX nor AVX512-BF16 on this CPU")
    monkeypatch.setattr(cpu_kernels, "_amx", amx and cpu_kernels.amx())
    model_dir = checkpoint_factory("llama", dtype="bfloat16")
    llm = small_llm(model_dir, dtype="auto", kv_cache_dtype=kv_cache_dtype)
    kv_dtype = torch.bfloat16 if kv_cache_dtype == "auto" else torch.float32
    assert llm.engine.dtype_name == "float32" and llm.engine.runner.kv_cache.dtype == kv_dtype
    head = llm.engine.model.output_weight
    assert (cpu_kernels.amx_weight(head) is not None) == amx
    prompts = make_prompts(llm.engine.model_config.vocab_size, set(), count=3, seed=3)
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=5))
    reference_dtype = torch.bfloat16 if amx else torch.float32
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=reference_dtype).eval()
    for prompt, out in zip(prompts, outs, strict=True):
        with torch.inference_mode():
            if amx or kv_dtype == torch.bfloat16:
                logits = hf(torch.tensor([prompt])).logits[0, -1].float()
                assert int(logits.argmax()) in out.outputs[0].logprobs[0]
                assert out.outputs[0].token_ids[0] in logits.topk(5).indices.tolist()
            else:
                expected = hf.generate(torch.tensor([prompt]), max_new_tokens=8, do_sample=False, min_new_tokens=8)
                assert out.outputs[0].token_ids == expected[0, len(prompt) :].tolist()


def values_of(param: torch.Tensor) -> torch.Tensor:
    """A parameter's float32 values, also where it is held as its bfloat16 copy."""
    from shared.kernels import cpu_kernels

    return cpu_kernels.unpacked(param) if cpu_kernels.held_shape(param) is not None else param


def test_bfloat16_dtype_on_cpu_holds_bfloat16_weights_on_the_float32_kernels(checkpoint_factory):
    """``--dtype bfloat16`` on the CPU (a small model): the weights rounded to bfloat16, computed as ``auto``
    computes a bfloat16 checkpoint (projections on bfloat16 products where the CPU has them, held as their
    bfloat16 copies there; float32 values otherwise), the KV cache in bfloat16; the same greedy tokens as the
    checkpoint saved in bfloat16 at ``auto``."""
    from shared.kernels import cpu_kernels

    float32_dir = checkpoint_factory("llama")
    llm = small_llm(float32_dir, dtype="bfloat16")
    params = [values_of(p) for p in llm.engine.model.parameters()]
    assert all(p.dtype == torch.float32 and torch.equal(p, p.bfloat16().float()) for p in params)
    as_saved = list(small_llm(float32_dir).engine.model.parameters())
    assert all(torch.equal(p, q.bfloat16().float()) for p, q in zip(params, as_saved, strict=True))
    assert not all(torch.equal(p, q) for p, q in zip(params, as_saved, strict=True))
    qkv = llm.engine.model.decoder_layers()[0].self_attn.qkv_proj.weight
    assert (cpu_kernels.held_shape(qkv) is not None) == cpu_kernels.bfloat16_holding()
    assert llm.engine.dtype_name == "bfloat16" and llm.engine.runner.kv_cache.dtype == torch.bfloat16
    assert (cpu_kernels.amx_weight(llm.engine.model.output_weight) is not None) == cpu_kernels.amx()
    bfloat16_dir = float32_dir.parent / "saved-in-bfloat16"
    from transformers import AutoModelForCausalLM, AutoTokenizer

    AutoModelForCausalLM.from_pretrained(float32_dir, dtype=torch.bfloat16).save_pretrained(bfloat16_dir)
    AutoTokenizer.from_pretrained(float32_dir).save_pretrained(bfloat16_dir)
    saved = small_llm(bfloat16_dir, dtype="auto")
    prompts = make_prompts(llm.engine.model_config.vocab_size, set(), count=3, seed=7)
    sampling = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    ours = [out.outputs[0].token_ids for out in llm.generate(prompts, sampling)]
    assert ours == [out.outputs[0].token_ids for out in saved.generate(prompts, sampling)]


@pytest.mark.parametrize("tied", [False, True])
def test_a_bfloat16_checkpoint_holds_its_weights_as_bfloat16_copies_at_any_size(checkpoint_factory, monkeypatch,
                                                                                tied):  # fmt: skip
    """Where bfloat16 products run, a bfloat16 checkpoint's projections, LM head and embedding are held as their
    bfloat16 copies alone (the parameters take about half the float32 model's bytes, not 1.5 times them), with
    the same greedy tokens and logprobs as float32 matrices beside their copies; and a checkpoint over
    ``CPU_FLOAT32_MAX_PARAMETERS`` (``auto``: bfloat16) runs so too instead of on torch's bfloat16 operators."""
    from shared.engine import engine_core
    from shared.kernels import cpu_kernels
    from shared.models.config import load_model_config

    if not cpu_kernels.bfloat16_holding():
        pytest.skip("neither AMX nor AVX512-BF16 on this CPU")
    model_dir = checkpoint_factory("llama", dtype="bfloat16", tie_word_embeddings=tied)
    prompts = make_prompts(load_model_config(model_dir).vocab_size, set(), count=4, seed=13)
    sampling = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=3)

    def run(**kwargs) -> tuple[LLM, list]:
        llm = small_llm(model_dir, dtype="auto", **kwargs)
        outs = [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in llm.generate(prompts, sampling)]
        return llm, outs

    held, held_outs = run()
    model = held.engine.model
    weights = [model.embed_tokens.weight, *model.projection_weights()]
    assert all(cpu_kernels.held_shape(w) is not None and w.dtype == torch.bfloat16 for w in weights)
    held_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    float32_bytes = 4 * held.engine.model_config.num_parameters
    assert held_bytes < 0.6 * float32_bytes
    monkeypatch.setattr(cpu_kernels, "bfloat16_holding", lambda: False)
    beside, beside_outs = run()
    assert cpu_kernels.held_shape(beside.engine.model.output_weight) is None
    assert held_outs == beside_outs
    monkeypatch.undo()
    monkeypatch.setattr(engine_core, "CPU_FLOAT32_MAX_PARAMETERS", 1)
    large, large_outs = run()
    assert large.engine.dtype_name == "bfloat16" and large.engine.runner.kv_cache.dtype == torch.bfloat16
    assert cpu_kernels.held_shape(large.engine.model.output_weight) is not None
    assert large_outs == held_outs


@pytest.mark.parametrize("kv, factor, tolerance", [("bfloat16", 2, 0.05), ("fp8", 4, 0.2), ("fp8_e5m2", 4, 0.3)])
def test_narrow_kv_cache_holds_more_tokens_and_stays_close(checkpoint_factory, kv, factor, tolerance):
    """A bfloat16 or float8 cache of a float32 model: a half or a quarter of the bytes a block (so two or four
    times the blocks in the same memory), and greedy outputs whose logprobs stay close to the float32 cache's
    (only K and V are rounded: to 8 mantissa bits, or 3 and 2)."""
    model_dir = checkpoint_factory("llama")
    params = SamplingParams(temperature=0.0, max_tokens=1, logprobs=5)
    runs = {}
    for dtype in ("float32", kv):
        llm = small_llm(model_dir, num_blocks=None, kv_cache_memory=1 << 20, kv_cache_dtype=dtype)
        prompts = make_prompts(llm.engine.model_config.vocab_size, set(), count=6, seed=5)
        runs[dtype] = (llm.engine.num_blocks, [out.outputs[0].logprobs[0] for out in llm.generate(prompts, params)])
    assert runs[kv][0] == factor * runs["float32"][0]
    worst = 0.0
    for exact, rounded in zip(runs["float32"][1], runs[kv][1], strict=True):
        top = next(iter(exact))
        assert top in rounded and next(iter(rounded)) in exact
        for token_id in exact.keys() & rounded.keys():
            worst = max(worst, abs(exact[token_id] - rounded[token_id]))
    assert worst < tolerance


def test_kv_cache_dtype_rule():
    from shared.engine.engine_core import resolve_kv_dtype

    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert resolve_kv_dtype("auto", "auto", "float32", "bfloat16", cpu) == "bfloat16"
    assert resolve_kv_dtype("auto", "float32", "float32", "bfloat16", cpu) == "float32"  # asked for float32
    assert resolve_kv_dtype("auto", "auto", "float32", "float32", cpu) == "float32"
    assert resolve_kv_dtype("auto", "auto", "bfloat16", "bfloat16", cpu) == "bfloat16"
    assert resolve_kv_dtype("float32", "auto", "float32", "bfloat16", cpu) == "float32"
    assert resolve_kv_dtype("bfloat16", "float32", "float32", "float32", cpu) == "bfloat16"
    assert resolve_kv_dtype("auto", "auto", "bfloat16", "bfloat16", cuda) == "bfloat16"
    for name, torch_name in [("fp8", "float8_e4m3fn"), ("fp8_e4m3", "float8_e4m3fn"), ("fp8_e5m2", "float8_e5m2")]:
        assert resolve_kv_dtype(name, "auto", "float32", "float32", cpu) == torch_name
        assert resolve_kv_dtype(name, "auto", "bfloat16", "bfloat16", cpu) == torch_name
        with pytest.raises(ValueError, match=f"--kv-cache-dtype {name} with .*float8 caches run on the CPU only"):
            resolve_kv_dtype(name, "auto", "bfloat16", "bfloat16", cuda)
    with pytest.raises(ValueError, match="KV cache is the model's dtype"):
        resolve_kv_dtype("float32", "auto", "bfloat16", "bfloat16", cuda)
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of auto, float32, bfloat16, fp8"):
        EngineConfig(model="unused", kv_cache_dtype="float8")


@pytest.mark.parametrize(
    "checkpoint_dtype, num_parameters, device, expected",
    [
        ("bfloat16", 15_000_000, "cpu", "float32"),
        ("bfloat16", 600_000_000, "cpu", "float32"),
        ("bfloat16", 1_235_000_000, "cpu", "bfloat16"),  # half the memory matters more there
        ("float16", 8_000_000_000, "cpu", "float32"),
        ("float32", 15_000_000, "cpu", "float32"),
        ("float32", 15_000_000, "cuda", "bfloat16"),
    ],
)
def test_auto_dtype(checkpoint_dtype, num_parameters, device, expected):
    from shared.engine.engine_core import _resolve_dtype

    assert _resolve_dtype("auto", checkpoint_dtype, torch.device(device), num_parameters) == expected
    assert _resolve_dtype("bfloat16", checkpoint_dtype, torch.device(device), num_parameters) == "bfloat16"


def test_bfloat16_engine_serves_and_agrees_with_hf_on_the_first_token(checkpoint_factory):
    from transformers import AutoModelForCausalLM

    model_dir = checkpoint_factory("qwen3")
    llm = small_llm(model_dir, dtype="bfloat16")
    assert llm.engine.runner.kv_cache.dtype == torch.bfloat16
    prompts = make_prompts(llm.engine.model_config.vocab_size, set(), count=4, seed=5)
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=5))
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).eval()
    for prompt, out in zip(prompts, outs, strict=True):
        assert len(out.outputs[0].token_ids) == 6
        with torch.inference_mode():
            hf_first = int(hf(torch.tensor([prompt])).logits[0, -1].float().argmax())
        # bfloat16 rounding may reorder near-ties; the reference's choice must be among our top 5.
        assert hf_first in out.outputs[0].logprobs[0]
    assert llm.engine.stats().num_free_blocks == llm.engine.num_blocks
