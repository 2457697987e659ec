"""Request fields beyond the common path, against scripted workers: refusals, token controls, token ids."""

from __future__ import annotations

import httpx
import openai
import pytest

from services.router.fields import KNOWN_FIELDS
from services.router.protocol import ChatCompletionRequest, CompletionRequest

MODEL = "tiny-test"
MESSAGES = [{"role": "user", "content": "Hello"}]
ENDPOINTS = {"/v1/completions": ({"prompt": "Hi"}, CompletionRequest), "/v1/chat/completions": ({"messages": MESSAGES}, ChatCompletionRequest)}  # fmt: skip


def post(router, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{router.url}{path}", json={"model": MODEL, "max_tokens": 3, **body}, timeout=30)


def error_of(response: httpx.Response, param: str) -> str:
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error"
    return error["message"]


@pytest.mark.parametrize("path", ENDPOINTS)
def test_every_unimplemented_schema_field_is_refused_by_name(agg_router, script, path):
    base, model = ENDPOINTS[path]
    unimplemented = [name for name in KNOWN_FIELDS if name not in model.model_fields]
    assert "suffix" in unimplemented and "logit_bias" not in unimplemented and "best_of" not in unimplemented
    for name in unimplemented:
        message = error_of(post(agg_router, path, {**base, name: 12345}), name)
        assert name in message
    assert not script.generate_requests, "a refused request reached a worker"


@pytest.mark.parametrize("path", ENDPOINTS)
def test_unknown_field_is_refused_and_off_values_pass(agg_router, script, path):
    base, _ = ENDPOINTS[path]
    assert "Unrecognized request argument supplied: frobnicate" in error_of(
        post(agg_router, path, {**base, "frobnicate": True}), "frobnicate"
    )
    off = {"best_of": 1, "use_beam_search": False, "suffix": None, "priority": 0, "logits_processors": []}
    assert post(agg_router, path, {**base, **off}).status_code == 200


def test_stream_options_without_stream_is_refused(agg_router, script):
    body = {"prompt": "Hi", "stream_options": {"include_usage": True}}
    assert "stream is true" in error_of(post(agg_router, "/v1/completions", body), "stream_options")


@pytest.mark.parametrize(
    "body, param, contains",
    [
        ({"logit_bias": {"99999": 5}}, "logit_bias", "token id 99999 is out of vocabulary (size "),
        ({"logit_bias": {"5": 101}}, "logit_bias", "outside [-100, 100]"),
        ({"logit_bias": {"abc": 1}}, "logit_bias", "token ids"),
        ({"allowed_token_ids": []}, "allowed_token_ids", "empty"),
        ({"allowed_token_ids": [3, 70000]}, "allowed_token_ids", "token id 70000 is out of vocabulary"),
        ({"bad_words": ["  "]}, "bad_words", "empty"),
        ({"truncate_prompt_tokens": 0}, "truncate_prompt_tokens", "-1 or at least 1"),
        ({"truncate_prompt_tokens": 10**6}, "truncate_prompt_tokens", "context length"),
        ({"logprobs": 21}, "logprobs", "[0, 20]"),
        ({"prompt": [5, 80000]}, "prompt", "token id 80000 is out of vocabulary"),
    ],
)
def test_token_field_errors_name_the_field_and_limit(agg_router, script, body, param, contains):
    assert contains in error_of(post(agg_router, "/v1/completions", {"prompt": "Hi", **body}), param)


def test_top_logprobs_bounds(agg_router, script):
    for value in (-1, 21):
        body = {"messages": MESSAGES, "logprobs": True, "top_logprobs": value}
        assert "[0, 20]" in error_of(post(agg_router, "/v1/chat/completions", body), "top_logprobs")


def test_token_controls_reach_the_worker(router, script, tokenizer):
    body = {"prompt": "Hi", "logit_bias": {"7": 100, "9": -100}, "allowed_token_ids": [7, 9, 11], "bad_words": ["cat"]}
    assert post(router, "/v1/completions", body).status_code == 200
    for sampling in (script.prefill_requests[0].sampling, script.generate_requests[0].sampling):
        assert dict(sampling.logit_bias) == {7: 100.0, 9: -100.0}
        assert list(sampling.allowed_token_ids.token_ids) == [7, 9, 11]
        words = [list(w.token_ids) for w in sampling.bad_words]
        assert tokenizer.encode("cat", add_special_tokens=False) in words
        assert tokenizer.encode(" cat", add_special_tokens=False) in words


def test_without_controls_the_wire_carries_none(agg_router, script):
    assert post(agg_router, "/v1/completions", {"prompt": "Hi"}).status_code == 200
    sampling = script.generate_requests[0].sampling
    assert not sampling.logit_bias and not sampling.HasField("allowed_token_ids") and not sampling.bad_words


@pytest.mark.parametrize("disaggregated", [True, False])
def test_return_token_ids_completions(router_factory, script, tokenizer, disaggregated):
    router = router_factory(prefill=disaggregated)
    client = openai.OpenAI(base_url=f"{router.url}/v1", api_key="x")
    out = client.completions.create(
        model=MODEL, prompt="Hello there", max_tokens=4, extra_body={"return_token_ids": True}
    )
    choice = out.choices[0].model_dump()
    assert choice["prompt_token_ids"] == tokenizer.encode("Hello there")
    assert choice["token_ids"] == script.ids(4)
    assert "token_ids" not in client.completions.create(model=MODEL, prompt="Hi", max_tokens=2).choices[0].model_dump()


def test_return_token_ids_chat_stream(router, script, tokenizer, stream_post):
    events = stream_post(
        router, "/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 4, "return_token_ids": True}
    )
    chunks = [e for e in events if e != "[DONE]"]
    assert chunks[0]["prompt_token_ids"] == list(script.prefill_requests[0].prompt_token_ids)
    streamed = [t for c in chunks[1:] for ch in c["choices"] for t in ch.get("token_ids") or []]
    assert streamed == script.ids(4)


def test_return_tokens_as_token_ids(agg_router, script):
    body = {"messages": MESSAGES, "logprobs": True, "top_logprobs": 2, "return_tokens_as_token_ids": True}
    content = post(agg_router, "/v1/chat/completions", body).json()["choices"][0]["logprobs"]["content"]
    assert [c["token"] for c in content] == [f"token_id:{t}" for t in script.ids(3)]
    assert content[0]["top_logprobs"][0]["token"] == f"token_id:{script.ids(1)[0] + 1}"


def test_truncate_prompt_tokens_keeps_the_last_tokens(agg_router, script):
    prompt = list(range(10, 30))
    assert post(agg_router, "/v1/completions", {"prompt": prompt, "truncate_prompt_tokens": 5}).status_code == 200
    assert list(script.generate_requests[0].prompt_token_ids) == prompt[-5:]


def test_echo_prepends_the_prompt(agg_router, script, tokenizer, stream_post):
    body = post(agg_router, "/v1/completions", {"prompt": ["Hi", "Yo"], "echo": True}).json()
    assert [c["text"] for c in body["choices"]] == [p + tokenizer.decode(script.ids(3)) for p in ("Hi", "Yo")]
    events = stream_post(agg_router, "/v1/completions", {"prompt": "Hi", "echo": True, "max_tokens": 3})
    text = "".join(c["text"] for e in events if e != "[DONE]" for c in e["choices"])
    assert text == "Hi" + tokenizer.decode(script.ids(3))


def test_continuous_usage_stats(agg_router, script, stream_post):
    body = {"prompt": "Hi", "max_tokens": 4, "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    chunks = [e for e in stream_post(agg_router, "/v1/completions", body) if e != "[DONE]"]
    counts = [c["usage"]["completion_tokens"] for c in chunks if c["choices"]]
    assert counts == sorted(counts) and counts[-1] == 4
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 4


@pytest.mark.parametrize("disaggregated", [True, False])
def test_prompt_logprobs_on_completions(router_factory, script, tokenizer, disaggregated):
    router = router_factory(prefill=disaggregated)
    body = post(router, "/v1/completions", {"prompt": "Hello there", "prompt_logprobs": 1}).json()
    [choice] = body["choices"]
    prompt = tokenizer.encode("Hello there")
    scores = choice["prompt_logprobs"]
    assert scores[0] is None and len(scores) == len(prompt)
    for position, (token, entry) in enumerate(zip(prompt[1:], scores[1:], strict=True), start=1):
        assert entry[str(token)] == {
            "logprob": pytest.approx(-position / 100),
            "rank": position,
            "decoded_token": tokenizer.decode([token], skip_special_tokens=False),
        }
        assert entry[str(token + 1)]["logprob"] == -1.0 and entry[str(token + 1)]["rank"] == 1
    if disaggregated:  # scored once, where the prompt was computed
        assert script.prefill_requests[0].sampling.prompt_logprobs == 1
        assert not script.generate_requests[0].sampling.HasField("prompt_logprobs")


def test_prompt_logprobs_on_chat_and_chat_stream(router, script, stream_post):
    body = post(router, "/v1/chat/completions", {"messages": MESSAGES, "prompt_logprobs": 0}).json()
    prompt = list(script.prefill_requests[0].prompt_token_ids)
    assert len(body["prompt_logprobs"]) == len(prompt) and body["prompt_logprobs"][0] is None
    assert list(body["prompt_logprobs"][1]) == [str(prompt[1])]
    events = stream_post(router, "/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 3, "prompt_logprobs": 0})
    with_scores = [e for e in events if e != "[DONE]" and "prompt_logprobs" in e]
    assert len(with_scores) == 1 and len(with_scores[0]["prompt_logprobs"]) == len(prompt)
    assert post(router, "/v1/chat/completions", {"messages": MESSAGES}).json()["prompt_logprobs"] is None


def test_echo_with_logprobs_puts_the_prompt_first(agg_router, script, tokenizer, stream_post):
    body = post(agg_router, "/v1/completions", {"prompt": "Hi", "echo": True, "logprobs": 1}).json()
    logprobs = body["choices"][0]["logprobs"]
    prompt = tokenizer.encode("Hi")
    texts = [tokenizer.decode([t], skip_special_tokens=False) for t in prompt]
    assert logprobs["tokens"][: len(prompt)] == texts
    assert logprobs["token_logprobs"][0] is None and logprobs["top_logprobs"][0] is None
    assert logprobs["token_logprobs"][1 : len(prompt)] == [pytest.approx(-p / 100) for p in range(1, len(prompt))]
    assert len(logprobs["tokens"]) == len(prompt) + 3
    assert logprobs["text_offset"][len(prompt)] == len("Hi")  # generated text starts after the echo
    assert body["choices"][0]["prompt_logprobs"] is None  # not asked for
    events = stream_post(agg_router, "/v1/completions", {"prompt": "Hi", "echo": True, "logprobs": 1, "max_tokens": 3})
    streamed = [t for e in events if e != "[DONE]" for c in e["choices"] for t in c["logprobs"]["tokens"]]
    assert streamed == logprobs["tokens"]


def test_fork_streams_every_choice_and_cuts_each_at_its_stop(agg_router, script, tokenizer, stream_post):
    stop = tokenizer.decode(script.ids(3, seed=1))[-2:]  # inside choice 1's text only at its third token
    body = {"prompt": ["Hi", "Yo"], "max_tokens": 5, "n": 3, "seed": 0, "stop": [stop]}
    events = stream_post(agg_router, "/v1/completions", body)
    texts: dict[int, str] = {}
    for event in events[:-1]:
        for choice in event["choices"]:
            texts[choice["index"]] = texts.get(choice["index"], "") + choice["text"]
    for index in range(6):
        full = tokenizer.decode(script.ids(5, seed=index % 3))
        assert texts[index] == (full[: full.index(stop)] if stop in full else full)
    assert [r.sampling.n for r in script.generate_requests] == [3, 3]


def test_chat_continue_final_message_and_echo(agg_router, script, tokenizer, stream_post):
    messages = [*MESSAGES, {"role": "assistant", "content": "Sure, the answer"}]
    body = {"messages": messages, "continue_final_message": True, "add_generation_prompt": False, "echo": True}
    out = post(agg_router, "/v1/chat/completions", body).json()
    prompt = list(script.generate_requests[0].prompt_token_ids)
    rendered = tokenizer.apply_chat_template(messages, add_generation_prompt=False)
    cut = rendered[: rendered.rfind("Sure, the answer") + len("Sure, the answer")]
    assert prompt == tokenizer.encode(cut, add_special_tokens=False)
    assert out["choices"][0]["message"]["content"] == "Sure, the answer" + tokenizer.decode(script.ids(3))
    events = stream_post(agg_router, "/v1/chat/completions", {**body, "max_tokens": 3})
    text = "".join(c["delta"].get("content") or "" for e in events[:-1] for c in e["choices"])
    assert text == "Sure, the answer" + tokenizer.decode(script.ids(3))
    # echo without a matching role adds nothing; both flags at once are refused
    plain = post(agg_router, "/v1/chat/completions", {"messages": MESSAGES, "echo": True}).json()
    assert plain["choices"][0]["message"]["content"] == tokenizer.decode(script.ids(3))
    both = post(agg_router, "/v1/chat/completions", {"messages": messages, "continue_final_message": True})
    assert error_of(both, "continue_final_message")


def test_unknown_stream_option_is_refused(agg_router, script):
    body = {"prompt": "Hi", "stream": True, "stream_options": {"include_usage": True, "chunk_size": 4}}
    assert "stream_options.chunk_size" in error_of(
        post(agg_router, "/v1/completions", body), "stream_options.chunk_size"
    )
