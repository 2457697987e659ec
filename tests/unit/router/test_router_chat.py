"""``/v1/chat/completions`` against scripted workers: template, streaming shape, usage, n, logprobs."""

from __future__ import annotations

import httpx
import openai
import pytest

MODEL = "tiny-test"
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello"}]


def post(router, body: dict) -> httpx.Response:
    return httpx.post(f"{router.url}/v1/chat/completions", json={"model": MODEL, **body}, timeout=30)


def prompt_ids(tokenizer, messages=MESSAGES) -> list[int]:
    return tokenizer.encode(tokenizer.apply_chat_template(messages), add_special_tokens=False)


def test_chat_non_stream(router, script, tokenizer):
    response = post(router, {"messages": MESSAGES, "max_tokens": 5})
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["object"] == "chat.completion" and body["id"].startswith("chatcmpl-")
    assert body["choices"] == [
        {
            "index": 0,
            "message": {"role": "assistant", "content": tokenizer.decode(script.ids(5))},
            "logprobs": None,
            "finish_reason": "length",
        }
    ]
    expected_prompt = prompt_ids(tokenizer)
    assert body["usage"] == {
        "prompt_tokens": len(expected_prompt),
        "completion_tokens": 5,
        "total_tokens": len(expected_prompt) + 5,
        "prompt_tokens_details": {"cached_tokens": 0},
    }
    assert list(script.prefill_requests[0].prompt_token_ids) == expected_prompt


def test_text_parts_render_like_a_string(agg_router, script, tokenizer):
    parts = [{"role": "user", "content": [{"type": "text", "text": "Hel"}, {"type": "text", "text": "lo"}]}]
    post(agg_router, {"messages": parts, "max_tokens": 2})
    expected = prompt_ids(tokenizer, [{"role": "user", "content": "Hel\nlo"}])
    assert list(script.generate_requests[0].prompt_token_ids) == expected


def test_max_completion_tokens_wins(agg_router, script):
    body = post(agg_router, {"messages": MESSAGES, "max_tokens": 9, "max_completion_tokens": 3}).json()
    assert body["usage"]["completion_tokens"] == 3


def test_max_tokens_omitted_uses_remaining_context(agg_router, script, tokenizer):
    post(agg_router, {"messages": MESSAGES})
    assert script.generate_requests[0].sampling.max_tokens == 256 - len(prompt_ids(tokenizer))


def test_chat_stream_shape(router, script, tokenizer, stream_post):
    body = {"messages": MESSAGES, "max_tokens": 6, "stream_options": {"include_usage": True}}
    events = stream_post(router, "/v1/chat/completions", {"model": MODEL, **body})
    assert events[-1] == "[DONE]"
    role, *content, usage = events[:-1]
    assert role["object"] == "chat.completion.chunk"
    assert role["choices"] == [
        {"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
    ]
    assert all(set(c["choices"][0]["delta"]) <= {"content"} for c in content)
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in content) == tokenizer.decode(script.ids(6))
    assert content[-1]["choices"][0]["finish_reason"] == "length"
    assert all(c["usage"] is None for c in [role, *content])
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 6
    assert usage["usage"]["prompt_tokens"] == len(prompt_ids(tokenizer))


def test_chat_stream_without_usage_has_no_usage_key(agg_router, script, stream_post):
    events = stream_post(agg_router, "/v1/chat/completions", {"model": MODEL, "messages": MESSAGES, "max_tokens": 3})
    assert all("usage" not in e for e in events[:-1])


def test_chat_n2_stream(router, script, tokenizer, stream_post):
    body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 4, "n": 2, "seed": 7}
    events = stream_post(router, "/v1/chat/completions", body)[:-1]
    roles = [e["choices"][0]["index"] for e in events if e["choices"][0]["delta"].get("role")]
    assert roles == [0, 1]
    texts = {0: "", 1: ""}
    for event in events:
        [choice] = event["choices"]
        texts[choice["index"]] += choice["delta"].get("content", "")
    assert texts == {i: tokenizer.decode(script.ids(4, seed=7 + i)) for i in (0, 1)}


def test_chat_stop_string(agg_router, script, tokenizer):
    full = tokenizer.decode(script.ids(40))
    body = post(agg_router, {"messages": MESSAGES, "max_tokens": 40, "stop": [" stops"]}).json()
    assert body["choices"][0]["message"]["content"] == full[: full.index(" stops")]
    assert body["choices"][0]["finish_reason"] == "stop"


def test_chat_logprobs(agg_router, script, tokenizer):
    body = post(agg_router, {"messages": MESSAGES, "max_tokens": 3, "logprobs": True, "top_logprobs": 2}).json()
    content = body["choices"][0]["logprobs"]["content"]
    ids = script.ids(3)
    assert [c["token"] for c in content] == [tokenizer.decode([i], skip_special_tokens=False) for i in ids]
    assert [c["logprob"] for c in content] == pytest.approx([-0.1, -0.2, -0.3])
    for entry in content:
        assert entry["bytes"] == list(entry["token"].encode())
        assert len(entry["top_logprobs"]) == 2
        assert set(entry["top_logprobs"][0]) == {"token", "logprob", "bytes"}
    assert script.generate_requests[0].sampling.logprobs == 2


def test_chat_logprobs_without_top(agg_router, script):
    body = post(agg_router, {"messages": MESSAGES, "max_tokens": 2, "logprobs": True}).json()
    assert [e["top_logprobs"] for e in body["choices"][0]["logprobs"]["content"]] == [[], []]


def test_chat_stream_logprobs(agg_router, script, stream_post):
    body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 3, "logprobs": True, "top_logprobs": 1}
    events = stream_post(agg_router, "/v1/chat/completions", body)[1:-1]
    entries = [entry for e in events for entry in e["choices"][0]["logprobs"]["content"]]
    assert len(entries) == 3 and all(len(e["top_logprobs"]) == 1 for e in entries)


def test_openai_client_chat(router, script, tokenizer):
    client = openai.OpenAI(base_url=f"{router.url}/v1", api_key="unused")
    reply = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_completion_tokens=4, seed=1)
    assert reply.choices[0].message.content == tokenizer.decode(script.ids(4, seed=1))
    stream = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=4, stream=True, stream_options={"include_usage": True}
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == tokenizer.decode(script.ids(4))
    assert chunks[-1].usage.total_tokens == chunks[-1].usage.prompt_tokens + 4
