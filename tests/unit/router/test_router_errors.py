"""Every error leaves in the OpenAI shape with the status of its cause; FastAPI's 422 never does."""

from __future__ import annotations

import grpc
import httpx
import openai
import pytest

MODEL = "tiny-test"
MESSAGES = [{"role": "user", "content": "Hello"}]


def assert_error(response: httpx.Response, status: int, *, param=None, code=None, contains: str = "") -> dict:
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) == {"error"}
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert isinstance(error["message"], str) and error["message"]
    assert isinstance(error["type"], str) and error["type"]
    if param is not None:
        assert error["param"] == param
    if code is not None:
        assert error["code"] == code
    assert contains in error["message"]
    return error


def completion(router, body: dict, **kwargs) -> httpx.Response:
    return httpx.post(f"{router.url}/v1/completions", json={"model": MODEL, **body}, timeout=30, **kwargs)


def chat(router, body: dict) -> httpx.Response:
    return httpx.post(f"{router.url}/v1/chat/completions", json={"model": MODEL, **body}, timeout=30)


@pytest.mark.parametrize(
    "body, param",
    [
        ({"prompt": "Hi", "temperature": "hot"}, "temperature"),
        ({"prompt": 5}, "prompt"),
        ({"prompt": ["a", 1]}, "prompt"),
        ({}, "prompt"),
        ({"prompt": "Hi", "max_tokens": "many"}, "max_tokens"),
        ({"prompt": "Hi", "stop": 3}, "stop"),
        ({"prompt": "Hi", "stream": "yes please"}, "stream"),
    ],
    ids=["temperature-type", "prompt-int", "prompt-mixed", "prompt-missing", "max-tokens-type", "stop-type", "stream"],
)
def test_wrong_types_are_400(agg_router, body, param):
    error = assert_error(completion(agg_router, body), 400, param=param)
    assert error["type"] == "invalid_request_error"


@pytest.mark.parametrize(
    "body, contains",
    [
        ({"prompt": "Hi", "max_tokens": -1}, "max_tokens"),
        ({"prompt": "Hi", "max_tokens": 0}, "max_tokens"),
        ({"prompt": ""}, "empty"),
        ({"prompt": []}, "empty"),
        ({"prompt": [[]]}, "empty"),
        ({"prompt": ["ok", ""]}, "empty"),
        ({"prompt": [5, 99999]}, "99999"),
        ({"prompt": [-1]}, "-1"),
        ({"prompt": "Hi", "stop_token_ids": [99999]}, "99999"),
        ({"prompt": "Hi", "temperature": -1}, "temperature"),
        ({"prompt": "Hi", "top_p": 2}, "top_p"),
        ({"prompt": "Hi", "n": 0}, "n: "),
        ({"prompt": "Hi", "n": 1000}, "n: "),
        ({"prompt": "Hi", "logprobs": 50}, "logprobs"),
        ({"prompt": "Hi", "prompt_logprobs": 21}, "prompt_logprobs"),
        ({"prompt": "Hi", "stop": [""]}, "stop"),
        ({"prompt": "Hi", "min_tokens": 20, "max_tokens": 5}, "min_tokens"),
        ({"prompt": "Hi", "seed": 2**70}, "seed"),
    ],
)
def test_invalid_completion_parameters_are_400(agg_router, script, body, contains):
    assert_error(completion(agg_router, body), 400, contains=contains)
    assert script.generate_requests == []


@pytest.mark.parametrize(
    "body, contains",
    [
        ({"messages": []}, "messages"),
        ({"messages": "Hello"}, "messages"),
        ({"messages": [{"content": "no role"}]}, "role"),
        ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "image_url"),
        ({"messages": MESSAGES, "top_logprobs": 2}, "top_logprobs"),
        ({"messages": MESSAGES, "logprobs": True, "top_logprobs": 30}, "logprobs"),
        ({"messages": MESSAGES, "max_completion_tokens": -5}, "max_completion_tokens"),
    ],
)
def test_invalid_chat_parameters_are_400(agg_router, script, body, contains):
    assert_error(chat(agg_router, body), 400, contains=contains)


def test_malformed_json_is_400(agg_router):
    response = httpx.post(
        f"{agg_router.url}/v1/completions",
        content=b'{"prompt": "Hi", ',
        headers={"content-type": "application/json"},
        timeout=30,
    )
    assert_error(response, 400, contains="JSON")


def test_prompt_longer_than_context(agg_router):
    error = assert_error(completion(agg_router, {"prompt": list(range(10, 310))}), 400, code="context_length_exceeded")
    assert error["message"].startswith(
        "This model's maximum context length is 256 tokens. However, you requested 301 tokens "
        "(300 in the messages, 1 in the completion)."
    )


def test_prompt_plus_max_tokens_over_context(agg_router):
    response = completion(agg_router, {"prompt": list(range(10, 210)), "max_tokens": 100})
    error = assert_error(response, 400, code="context_length_exceeded")
    assert "However, you requested 300 tokens (200 in the messages, 100 in the completion)" in error["message"]


def test_chat_over_context(agg_router):
    response = chat(agg_router, {"messages": [{"role": "user", "content": "word " * 300}]})
    assert_error(response, 400, contains="maximum context length is 256 tokens")


def test_unknown_model_is_404(agg_router):
    error = assert_error(completion(agg_router, {"prompt": "Hi", "model": "gpt-9"}), 404, param="model")
    assert error["code"] == "model_not_found"
    assert_error(chat(agg_router, {"messages": MESSAGES, "model": "gpt-9"}), 404)


def test_openai_client_sees_typed_errors(agg_router):
    client = openai.OpenAI(base_url=f"{agg_router.url}/v1", api_key="unused", max_retries=0)
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=MODEL, prompt="Hi", max_tokens=-3)
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="nope", messages=MESSAGES)


def test_no_workers_is_503(router_factory):
    router = router_factory(prefill=False, decode=False)
    assert_error(completion(router, {"prompt": "Hi"}), 503, contains="no decode workers")
    assert_error(chat(router, {"messages": MESSAGES, "stream": True}), 503)
    assert httpx.get(f"{router.url}/health").status_code == 503


def test_unreachable_worker_is_503(router_factory):
    router = router_factory(prefill=False, decode=["127.0.0.1:1"])
    assert_error(completion(router, {"prompt": "Hi"}), 503, contains="decode worker")
    assert httpx.get(f"{router.url}/health").status_code == 503


def test_unreachable_prefill_worker_falls_back_to_aggregated(router_factory, script, worker_addrs):
    router = router_factory(prefill=["127.0.0.1:1"], decode=[worker_addrs["decode"]])
    response = completion(router, {"prompt": "Hi", "max_tokens": 3})
    assert response.status_code == 200
    assert not script.generate_requests[0].HasField("kv_handle")


@pytest.mark.parametrize("stream", [False, True])
def test_worker_internal_error_is_500(agg_router, script, stream):
    script.fail_generate = grpc.StatusCode.INTERNAL
    error = assert_error(completion(agg_router, {"prompt": "Hi", "stream": stream}), 500)
    assert error["type"] == "server_error"


def test_worker_invalid_argument_is_400(agg_router, script):
    script.fail_generate = grpc.StatusCode.INVALID_ARGUMENT
    assert_error(completion(agg_router, {"prompt": "Hi"}), 400, contains="injected generate failure")


def test_prefill_worker_error_is_500(router, script):
    script.fail_prefill = grpc.StatusCode.INTERNAL
    assert_error(completion(router, {"prompt": "Hi", "max_tokens": 4}), 500, contains="prefill")


def test_unknown_route_and_method(agg_router):
    assert_error(httpx.get(f"{agg_router.url}/v1/nothing-here"), 404)
    assert_error(httpx.get(f"{agg_router.url}/v1/completions"), 405)
