"""Token-level fields through the real cluster (official openai client), aggregated and disaggregated.

One prefill and one decode worker serve two routers: one that disaggregates
every request and one with no prefill pool (aggregated). ``logit_bias`` must
force and ban tokens in the engine's batched sampler, ``return_token_ids`` must
equal the tokenizer's and the offline engine's ids, and ``cached_tokens`` must
equal the prefill worker's prefix-cache hit.
"""

from __future__ import annotations

import httpx
import openai
import pytest

from shared.engine import LLM, SamplingParams
from tests.integration.cluster import start_router, start_worker, wait_worker

PROMPT = "once upon a time there was a garden by the sea"
BLOCK_SIZE = 16
MAX_TOKENS = 6

pytestmark = pytest.mark.slow  # starts two workers and two routers


@pytest.fixture(scope="module")
def servers(model_dir):
    prefill, decode = (
        start_worker("prefill", model_dir, "--kv-transfer-backend", "tcp"),
        start_worker("decode", model_dir, "--kv-transfer-backend", "tcp"),
    )
    procs = [wait_worker(prefill), wait_worker(decode)]
    try:
        disagg_router, disagg_url = start_router(model_dir, [prefill], [decode])
        procs.append(disagg_router)
        agg_router, agg_url = start_router(model_dir, [], [decode])
        procs.append(agg_router)
        name = httpx.get(f"{agg_url}/v1/models").json()["data"][0]["id"]
        yield {"disaggregated": disagg_url, "aggregated": agg_url, "name": name}
    finally:
        for proc in reversed(procs):
            proc.stop()


@pytest.fixture(scope="module")
def reference(model_dir):
    """Greedy ids of the offline engine (itself checked against transformers)."""
    llm = LLM(model=str(model_dir), dtype="float32", num_blocks=256)
    prompt_ids = llm.tokenizer.encode(PROMPT)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    return prompt_ids, llm.generate([prompt_ids], params)[0].outputs[0].token_ids


def client(servers, path: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{servers[path]}/v1", api_key="unused", max_retries=0, timeout=120)


def complete(servers, path: str, **extra_body):
    return client(servers, path).completions.create(
        model=servers["name"],
        prompt=PROMPT,
        max_tokens=MAX_TOKENS,
        temperature=0,
        extra_body={"ignore_eos": True, **extra_body},
    )


@pytest.mark.parametrize("path", ["aggregated", "disaggregated"])
def test_return_token_ids_equal_the_tokenizer_and_the_engine(servers, reference, path):
    prompt_ids, output_ids = reference
    choice = complete(servers, path, return_token_ids=True).choices[0].model_dump()
    assert choice["prompt_token_ids"] == prompt_ids
    assert choice["token_ids"] == output_ids


@pytest.mark.parametrize("path", ["aggregated", "disaggregated"])
def test_logit_bias_forces_and_bans(servers, reference, path):
    _, output_ids = reference
    forced = 1234
    out = complete(servers, path, logit_bias={str(forced): 100}, return_token_ids=True).choices[0].model_dump()
    assert out["token_ids"] == [forced] * MAX_TOKENS
    banned = complete(servers, path, logit_bias={str(output_ids[0]): -100}, return_token_ids=True)
    assert banned.choices[0].model_dump()["token_ids"][0] != output_ids[0]


def test_allowed_token_ids_and_bad_words(servers, reference):
    _, output_ids = reference
    allowed = [output_ids[0] + 1, 77]
    out = complete(servers, "disaggregated", allowed_token_ids=allowed, return_token_ids=True)
    assert set(out.choices[0].model_dump()["token_ids"]) <= set(allowed)


def test_cached_tokens_are_the_prefill_workers_prefix_hit(servers):
    long_prompt = PROMPT + " and the garden grew" * 6
    body = {
        "model": servers["name"],
        "prompt": long_prompt,
        "max_tokens": 2,
        "ignore_eos": True,
        "return_token_ids": True,
    }
    first = httpx.post(f"{servers['disaggregated']}/v1/completions", json=body, timeout=120).json()
    num_prompt = len(first["choices"][0]["prompt_token_ids"])
    second = httpx.post(f"{servers['disaggregated']}/v1/completions", json=body, timeout=120).json()
    expected_hit = (num_prompt - 1) // BLOCK_SIZE * BLOCK_SIZE
    assert expected_hit >= BLOCK_SIZE
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] == expected_hit
    chat = client(servers, "disaggregated").chat.completions.create(
        model=servers["name"], messages=[{"role": "user", "content": long_prompt}], max_tokens=2
    )
    assert chat.usage.prompt_tokens_details is not None


@pytest.fixture(scope="module")
def hf_prompt_scores(model_dir, reference):
    """transformers' log_softmax of the prompt's logits: position p scores prompt token p + 1."""
    import torch
    from transformers import AutoModelForCausalLM

    prompt_ids, _ = reference
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.inference_mode():
        logprobs = model(torch.tensor([prompt_ids])).logits[0].float().log_softmax(dim=-1)  # [P, V]
    return [logprobs[p - 1, prompt_ids[p]].item() for p in range(1, len(prompt_ids))]


@pytest.mark.parametrize("path", ["aggregated", "disaggregated"])
def test_echo_logprobs_and_prompt_logprobs_equal_transformers(servers, reference, hf_prompt_scores, path):
    prompt_ids, _ = reference
    out = complete(servers, path, echo=True, logprobs=2, prompt_logprobs=1).choices[0].model_dump()
    assert out["text"].startswith(PROMPT)
    echoed = out["logprobs"]["token_logprobs"][: len(prompt_ids)]
    assert echoed[0] is None
    assert echoed[1:] == pytest.approx(hf_prompt_scores, abs=1e-3)
    scores = out["prompt_logprobs"]
    assert scores[0] is None
    got = [scores[p][str(prompt_ids[p])]["logprob"] for p in range(1, len(prompt_ids))]
    assert got == pytest.approx(hf_prompt_scores, abs=1e-3)


@pytest.fixture(scope="module")
def hf_hidden(model_dir):
    """Final (normed) hidden states of transformers' forward pass, per input text."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)

    def hidden(text: str):
        with torch.inference_mode():
            return model.model(torch.tensor([tokenizer(text)["input_ids"]])).last_hidden_state[0]  # [P, hidden]

    return hidden


def test_embeddings_equal_transformers_pooled_the_same_way(servers, hf_hidden):
    import base64
    import struct

    import torch

    texts = [PROMPT, "hello", "a long story about the sea and the ships"]
    api = client(servers, "disaggregated")
    out = api.embeddings.create(model=servers["name"], input=texts)
    assert [d.index for d in out.data] == [0, 1, 2]
    for text, item in zip(texts, out.data, strict=True):
        expected = torch.nn.functional.normalize(hf_hidden(text)[-1], dim=0)
        assert torch.allclose(torch.tensor(item.embedding), expected, atol=1e-4)
    body = {"model": servers["name"], "input": texts[0], "pooling": "mean", "normalize": False}
    mean = httpx.post(f"{servers['aggregated']}/v1/embeddings", json={**body, "encoding_format": "base64"}).json()
    raw = base64.b64decode(mean["data"][0]["embedding"])
    vector = torch.tensor(struct.unpack(f"<{len(raw) // 4}f", raw))
    assert torch.allclose(vector, hf_hidden(texts[0]).mean(dim=0), atol=1e-4)
    assert mean["usage"]["prompt_tokens"] == hf_hidden(texts[0]).shape[0]
    refused = httpx.post(f"{servers['aggregated']}/v1/embeddings", json={**body, "dimensions": 3})
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "dimensions"


def routed(servers, path: str) -> dict[str, float]:
    """The router's sequences by route taken (aggregated / disaggregated)."""
    counts = {"aggregated": 0.0, "disaggregated": 0.0}
    for line in httpx.get(f"{servers[path]}/metrics").text.splitlines():
        if line.startswith("cleave_router_routed_sequences_total{"):
            for route in counts:
                if f'"{route}"' in line:
                    counts[route] += float(line.rsplit(" ", 1)[1])
    return counts


@pytest.mark.parametrize("path", ["aggregated", "disaggregated"])
def test_n_is_one_engine_fork_equal_to_the_offline_engine(servers, model_dir, path):
    llm = LLM(model=str(model_dir), dtype="float32", num_blocks=256)
    params = SamplingParams(n=4, temperature=0.9, seed=11, max_tokens=MAX_TOKENS, ignore_eos=True)
    [expected] = llm.generate([llm.tokenizer.encode(PROMPT)], params)
    before = routed(servers, path)
    out = complete(servers, path, n=4, temperature=0.9, seed=11, return_token_ids=True)
    got = {c.index: c.model_dump()["token_ids"] for c in out.choices}
    assert [got[i] for i in range(4)] == [o.token_ids for o in expected.outputs]
    assert len({tuple(ids) for ids in got.values()}) > 1
    # With a prefill pool the fork prefills once there, is pulled once and forks on the decode worker.
    after = routed(servers, path)
    assert after[path] - before[path] == 1 and sum(after.values()) - sum(before.values()) == 1


# ---- beam search: runs whole on the decode worker on both paths ---------------------------------------


@pytest.mark.parametrize("path", ["aggregated", "disaggregated"])
def test_beam_search_equals_transformers(servers, model_dir, path):
    from tests.unit.engine.test_beam_search import hf_beam_search

    llm_tokenizer = LLM(model=str(model_dir), dtype="float32", num_blocks=64).tokenizer
    prompt_ids = llm_tokenizer.encode(PROMPT)
    expected = hf_beam_search(
        model_dir, prompt_ids, num_beams=4, num_return=3, max_tokens=8, length_penalty=0.5, early_stopping=False
    )
    out = client(servers, path).completions.create(
        model=servers["name"], prompt=PROMPT, max_tokens=8, n=3,
        extra_body={"use_beam_search": True, "best_of": 4, "length_penalty": 0.5, "return_token_ids": True},
    )  # fmt: skip
    got = {c.index: c.model_dump()["token_ids"] for c in out.choices}
    assert [got[i] for i in range(3)] == expected
    assert out.usage.completion_tokens == sum(len(ids) for ids in expected)
    chunks = client(servers, path).completions.create(
        model=servers["name"], prompt=PROMPT, max_tokens=8, n=3, stream=True,
        extra_body={"use_beam_search": True, "best_of": 4, "length_penalty": 0.5},
    )  # fmt: skip
    texts = ["", "", ""]
    for chunk in chunks:
        for choice in chunk.choices:
            texts[choice.index] += choice.text
    assert texts == [c.text for c in sorted(out.choices, key=lambda c: c.index)]


def test_beam_search_refusals_name_the_field(servers):
    base = {"model": servers["name"], "prompt": PROMPT, "max_tokens": 4}
    for extra, param in [
        ({"use_beam_search": True, "n": 3, "best_of": 2}, "best_of"),
        ({"best_of": 3}, "best_of"),
        ({"use_beam_search": True, "stop": ["x"]}, "stop"),
        ({"length_penalty": 2.0}, "length_penalty"),
    ]:
        response = httpx.post(f"{servers['aggregated']}/v1/completions", json={**base, **extra})
        assert response.status_code == 400 and response.json()["error"]["param"] == param, (extra, response.text)


def test_beam_search_on_chat_returns_the_n_best_beams(servers):
    out = client(servers, "aggregated").chat.completions.create(
        model=servers["name"], messages=[{"role": "user", "content": PROMPT}], max_tokens=6, n=2,
        extra_body={"use_beam_search": True, "best_of": 3, "ignore_eos": True, "return_token_ids": True},
    )  # fmt: skip
    choices = sorted(out.choices, key=lambda c: c.index)
    assert [c.finish_reason for c in choices] == ["length", "length"]
    token_ids = [c.model_dump()["token_ids"] for c in choices]
    assert all(len(ids) == 6 for ids in token_ids) and token_ids[0] != token_ids[1]
