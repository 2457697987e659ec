"""``/v1/completions`` against scripted workers: paths, prompt forms, streaming, stops, n, logprobs."""

from __future__ import annotations

import json
import threading
import time

import httpx
import openai
import pytest

MODEL = "tiny-test"


def post(router, body: dict) -> httpx.Response:
    return httpx.post(f"{router.url}/v1/completions", json={"model": MODEL, **body}, timeout=30)


def test_disaggregated_completion(router, script, tokenizer):
    response = post(router, {"prompt": "Hello there", "max_tokens": 5})
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["object"] == "text_completion" and body["model"] == MODEL
    assert body["id"] == response.headers["x-request-id"]
    [choice] = body["choices"]
    assert choice == {
        "index": 0,
        "text": tokenizer.decode(script.ids(5)),
        "logprobs": None,
        "finish_reason": "length",
        "prompt_logprobs": None,
    }
    num_prompt = len(tokenizer.encode("Hello there"))
    assert body["usage"] == {
        "prompt_tokens": num_prompt,
        "completion_tokens": 5,
        "total_tokens": num_prompt + 5,
        "prompt_tokens_details": {"cached_tokens": 0},
    }
    [prefill] = script.prefill_requests
    [generate] = script.generate_requests
    assert list(prefill.prompt_token_ids) == tokenizer.encode("Hello there")
    assert generate.HasField("first_token") and generate.HasField("kv_handle")
    assert generate.first_token.token_id == script.ids(1)[0]
    assert generate.kv_handle.request_id == prefill.request_id == generate.request_id
    assert generate.sampling.max_tokens == 5


def test_aggregated_without_prefill_workers(agg_router, script, tokenizer):
    body = post(agg_router, {"prompt": "Hello", "max_tokens": 4}).json()
    assert body["choices"][0]["text"] == tokenizer.decode(script.ids(4))
    [generate] = script.generate_requests
    assert not generate.HasField("first_token") and not generate.HasField("kv_handle")
    assert script.prefill_requests == []


def test_single_token_request_skips_prefill_pool(router, script, tokenizer):
    body = post(router, {"prompt": "Hello", "max_tokens": 1}).json()
    assert body["choices"][0]["text"] == tokenizer.decode(script.ids(1))
    assert script.prefill_requests == [] and len(script.generate_requests) == 1


def test_finished_at_first_token_needs_no_decode(router, script):
    script.eos_at = 0
    body = post(router, {"prompt": "Hello", "max_tokens": 8}).json()
    assert body["choices"][0]["text"] == "" and body["choices"][0]["finish_reason"] == "stop"
    assert body["usage"]["completion_tokens"] == 1
    assert len(script.prefill_requests) == 1 and script.generate_requests == []


@pytest.mark.parametrize(
    "prompt",
    [["one", "two words"], [[5, 6, 7], [8, 9]]],
    ids=["strings", "token-lists"],
)
def test_several_prompts(agg_router, script, tokenizer, prompt):
    body = post(agg_router, {"prompt": prompt, "max_tokens": 3}).json()
    assert [c["index"] for c in body["choices"]] == [0, 1]
    assert all(c["text"] == tokenizer.decode(script.ids(3)) for c in body["choices"])
    prompt_ids = [tokenizer.encode(p) if isinstance(p, str) else p for p in prompt]
    assert body["usage"]["prompt_tokens"] == sum(len(p) for p in prompt_ids)
    assert sorted(list(r.prompt_token_ids) for r in script.generate_requests) == sorted(prompt_ids)


def test_token_id_prompt(agg_router, script):
    body = post(agg_router, {"prompt": [10, 11, 12], "max_tokens": 2}).json()
    assert body["usage"]["prompt_tokens"] == 3
    assert list(script.generate_requests[0].prompt_token_ids) == [10, 11, 12]


def test_max_tokens_omitted_defaults_to_16(agg_router, script):
    body = post(agg_router, {"prompt": "Hi"}).json()
    assert body["usage"]["completion_tokens"] == 16
    assert script.generate_requests[0].sampling.max_tokens == 16


def test_default_max_tokens_is_capped_to_the_context(agg_router, script):
    body = post(agg_router, {"prompt": list(range(10, 250))}).json()  # 240 of 256 tokens
    assert body["usage"]["completion_tokens"] == 16
    body = post(agg_router, {"prompt": list(range(10, 250)) + [5] * 10}).json()  # 250 of 256
    assert body["usage"]["completion_tokens"] == 6
    assert script.generate_requests[-1].sampling.max_tokens == 6


def test_stream_matches_non_stream(router, script, tokenizer, stream_post):
    events = stream_post(router, "/v1/completions", {"model": MODEL, "prompt": "Hi", "max_tokens": 12})
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert all(c["object"] == "text_completion" and "usage" not in c for c in chunks)
    assert "".join(c["choices"][0]["text"] for c in chunks) == tokenizer.decode(script.ids(12))
    assert [c["choices"][0]["finish_reason"] for c in chunks][-1] == "length"
    assert all(c["choices"][0]["finish_reason"] is None for c in chunks[:-1])


def test_stream_include_usage(router, script, stream_post):
    body = {"model": MODEL, "prompt": "Hi", "max_tokens": 4, "stream_options": {"include_usage": True}}
    events = stream_post(router, "/v1/completions", body)
    *chunks, usage_chunk, done = events
    assert done == "[DONE]"
    assert usage_chunk["choices"] == []
    assert usage_chunk["usage"]["completion_tokens"] == 4
    assert all(c["usage"] is None for c in chunks)


def _full_text(script, tokenizer, n=40):
    return tokenizer.decode(script.ids(n))


def test_stop_string_split_across_tokens_is_never_streamed(router, script, tokenizer, stream_post, eventually):
    full = _full_text(script, tokenizer)
    assert "END" in full and "END" not in tokenizer.decode(script.ids(1))
    events = stream_post(router, "/v1/completions", {"model": MODEL, "prompt": "Hi", "max_tokens": 40, "stop": "END"})
    texts = [e["choices"][0]["text"] for e in events[:-1]]
    assert "".join(texts) == full[: full.index("END")]
    assert not any(t.endswith(("E", "EN")) for t in texts if t.strip())
    assert events[-2]["choices"][0]["finish_reason"] == "stop"
    generated = script.generate_requests[0].request_id
    assert eventually(lambda: generated in script.aborted)


def test_stop_string_non_stream_with_list(agg_router, script, tokenizer):
    full = _full_text(script, tokenizer)
    body = post(agg_router, {"prompt": "Hi", "max_tokens": 40, "stop": ["zzz", "client."]}).json()
    assert body["choices"][0]["text"] == full[: full.index("client.")]
    assert body["choices"][0]["finish_reason"] == "stop"
    # Tokens are counted up to the one that completed the stop string.
    consumed = next(k for k in range(1, 40) if "client." in tokenizer.decode(script.ids(k)))
    assert body["usage"]["completion_tokens"] == consumed


@pytest.mark.parametrize("first_token_at", ["decode", "prefill"])
def test_stop_string_in_first_token_releases_the_kv(router_factory, script, tokenizer, eventually, first_token_at):
    router = router_factory(first_token_at=first_token_at)
    first_text = tokenizer.decode(script.ids(1))
    body = post(router, {"prompt": "Hi", "max_tokens": 10, "stop": first_text.strip()}).json()
    assert body["choices"][0]["finish_reason"] == "stop"
    assert body["choices"][0]["text"] == first_text[: first_text.index(first_text.strip())]
    if first_token_at == "prefill":
        assert script.generate_requests == []  # the router saw the stop before it asked a decode worker
    else:  # the token waited for the decode worker's announcement; the request there ends at once
        assert eventually(lambda: script.generate_requests[0].request_id in script.aborted)
    assert eventually(lambda: script.prefill_requests[0].request_id in script.released)


def _stream_in_background(router, body: dict) -> tuple[list, threading.Thread]:
    """POST ``body`` streaming; the SSE payloads land in the returned list as they arrive."""
    events: list = []

    def run() -> None:
        with httpx.Client(base_url=router.url, timeout=30) as client:
            with client.stream("POST", "/v1/completions", json={"model": MODEL, **body, "stream": True}) as resp:
                for line in resp.iter_lines():
                    if line.startswith("data: {"):
                        events.append(json.loads(line[len("data: ") :]))

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return events, thread


def test_first_token_waits_for_the_decode_worker_to_queue_the_request(router, script, tokenizer, eventually):
    script.decode_gate = threading.Event()
    events, thread = _stream_in_background(router, {"prompt": "Hi", "max_tokens": 6})
    assert eventually(lambda: len(script.generate_requests) == 1)
    assert script.generate_requests[0].announce_admission
    time.sleep(0.3)  # the router has the prefill's first token, and holds it
    assert events == []
    script.decode_gate.set()
    thread.join(timeout=30)
    # One chunk per token (the announcement is none), then the usage-less final chunk has the finish reason.
    texts = [e["choices"][0]["text"] for e in events if e.get("choices")]
    assert "".join(texts) == tokenizer.decode(script.ids(6))
    assert len(texts) == 6


def test_first_token_at_prefill_goes_out_before_the_decode_worker_answers(
    router_factory, script, tokenizer, eventually
):
    router = router_factory(first_token_at="prefill")
    script.decode_gate = threading.Event()
    events, thread = _stream_in_background(router, {"prompt": "Hi", "max_tokens": 6})
    try:
        assert eventually(lambda: len(events) == 1)
        assert events[0]["choices"][0]["text"] == tokenizer.decode(script.ids(1))
        # The router asks the decode worker after the first token went out (or just before): wait for the ask.
        assert eventually(lambda: len(script.generate_requests) == 1)
        assert not script.generate_requests[0].announce_admission
    finally:
        script.decode_gate.set()
        thread.join(timeout=30)
    assert "".join(e["choices"][0]["text"] for e in events) == tokenizer.decode(script.ids(6))


def test_stop_token_id_text_is_dropped(agg_router, script, tokenizer):
    stop_id = script.token_ids[2]
    body = post(agg_router, {"prompt": "Hi", "max_tokens": 10, "stop_token_ids": [stop_id]}).json()
    assert body["choices"][0] == {
        "index": 0,
        "text": tokenizer.decode(script.ids(2)),
        "logprobs": None,
        "finish_reason": "stop",
        "prompt_logprobs": None,
    }
    assert body["usage"]["completion_tokens"] == 3


def test_eos_finishes_with_stop(agg_router, script, tokenizer):
    script.eos_at = 3
    body = post(agg_router, {"prompt": "Hi", "max_tokens": 10}).json()
    assert body["choices"][0]["text"] == tokenizer.decode(script.ids(3))
    assert body["choices"][0]["finish_reason"] == "stop"


def test_ignore_eos_is_forwarded(agg_router, script):
    post(agg_router, {"prompt": "Hi", "max_tokens": 3, "ignore_eos": True, "top_k": 5, "min_p": 0.1})
    sampling = script.generate_requests[0].sampling
    assert sampling.ignore_eos and sampling.top_k == 5 and sampling.min_p == pytest.approx(0.1)


def test_multibyte_text_streams_whole_characters(agg_router, script, tokenizer, stream_post):
    count = len(script.token_ids)
    events = stream_post(agg_router, "/v1/completions", {"model": MODEL, "prompt": "Hi", "max_tokens": count})
    texts = [e["choices"][0]["text"] for e in events[:-1]]
    assert "".join(texts) == tokenizer.decode(script.ids(count))
    assert "Caf\u00e9 \u4e16\u754c!" in "".join(texts)
    assert not any("\ufffd" in t for t in texts)


def test_every_token_has_a_chunk_while_its_text_is_held(agg_router, script, tokenizer, stream_post):
    """A token that ends inside a character streams an empty-text chunk: clients see one chunk per token."""
    count = len(script.token_ids)
    events = stream_post(agg_router, "/v1/completions", {"model": MODEL, "prompt": "Hi", "max_tokens": count})
    chunks = [e for e in events if isinstance(e, dict) and e.get("choices")]
    assert len(chunks) == count
    held = [c for c in chunks if c["choices"][0]["text"] == ""]
    assert held, "the script splits a character across tokens, so some token has no text yet"
    assert "".join(c["choices"][0]["text"] for c in chunks) == tokenizer.decode(script.ids(count))
    chat = stream_post(agg_router, "/v1/chat/completions",
                       {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": count})  # fmt: skip
    deltas = [e["choices"][0]["delta"] for e in chat[:-1] if e["choices"] and "role" not in e["choices"][0]["delta"]]
    assert len(deltas) == count and all(isinstance(d.get("content"), str) for d in deltas)


def test_n2_is_one_forked_request_with_distinct_seeds(router, script, tokenizer):
    body = post(router, {"prompt": "Hi", "max_tokens": 4, "n": 2, "seed": 3}).json()
    choices = sorted(body["choices"], key=lambda c: c["index"])
    assert [c["text"] for c in choices] == [tokenizer.decode(script.ids(4, seed=s)) for s in (3, 4)]
    # One prefill (one sample, on the prefill worker), one pull and the engine's fork, instead of n requests.
    [generate] = script.generate_requests
    assert generate.sampling.n == 2 and generate.sampling.seed == 3 and generate.HasField("kv_handle")
    [prefill] = script.prefill_requests
    assert prefill.sampling.n == 1 and prefill.sampling.ignore_eos
    assert body["usage"]["completion_tokens"] == 8


def test_n2_stream(router, script, tokenizer, stream_post):
    events = stream_post(router, "/v1/completions", {"model": MODEL, "prompt": "Hi", "max_tokens": 5, "n": 2})
    texts = {0: "", 1: ""}
    for event in events[:-1]:
        [choice] = event["choices"]
        texts[choice["index"]] += choice["text"]
    assert texts == {0: tokenizer.decode(script.ids(5)), 1: tokenizer.decode(script.ids(5))}


def test_logprobs_shape(agg_router, script, tokenizer):
    body = post(agg_router, {"prompt": "Hi", "max_tokens": 4, "logprobs": 2}).json()
    logprobs = body["choices"][0]["logprobs"]
    ids = script.ids(4)
    assert logprobs["tokens"] == [tokenizer.decode([i], skip_special_tokens=False) for i in ids]
    assert logprobs["token_logprobs"] == pytest.approx([-0.1, -0.2, -0.3, -0.4])
    assert len(logprobs["top_logprobs"]) == 4
    for token, top in zip(logprobs["tokens"], logprobs["top_logprobs"], strict=True):
        assert token in top and 2 <= len(top) <= 3
    assert logprobs["text_offset"][0] == 0 and logprobs["text_offset"] == sorted(logprobs["text_offset"])
    assert script.generate_requests[0].sampling.logprobs == 2


def test_openai_client(router, script, tokenizer):
    client = openai.OpenAI(base_url=f"{router.url}/v1", api_key="unused")
    completion = client.completions.create(model=MODEL, prompt="Hello", max_tokens=6)
    assert completion.choices[0].text == tokenizer.decode(script.ids(6))
    assert completion.usage.completion_tokens == 6
    stream = client.completions.create(
        model=MODEL, prompt="Hello", max_tokens=6, stream=True, stream_options={"include_usage": True}
    )
    chunks = list(stream)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == tokenizer.decode(script.ids(6))
    assert chunks[-1].usage.completion_tokens == 6


def test_model_may_be_omitted(agg_router):
    response = httpx.post(f"{agg_router.url}/v1/completions", json={"prompt": "Hi", "max_tokens": 2}, timeout=30)
    assert response.status_code == 200
