"""Hostile input at the HTTP edge: out-of-range numbers, values OpenAI refuses, non-finite
JSON, and a published schema that matches what the server answers."""

from __future__ import annotations

import json
import math

import httpx
import pytest

from services.router.protocol import choice_params
from services.router.serving import MIN_LOGPROB, _lp, sse
from shared.engine.sampling_params import InvalidRequestError, SamplingParams
from tests.unit.router.test_router_errors import MODEL, assert_error

MESSAGES = [{"role": "user", "content": "Hello"}]


def post_raw(router, path: str, body: dict, **kwargs) -> httpx.Response:
    """POST ``body`` as JSON that may carry NaN/Infinity literals (as a hostile client may send)."""
    data = json.dumps({"model": MODEL, **body}, allow_nan=True)
    return httpx.post(f"{router.url}{path}", content=data, headers={"content-type": "application/json"}, timeout=30)


@pytest.mark.parametrize(
    "body, param",
    [
        ({"prompt": "Hi", "top_k": 2**31}, "top_k"),
        ({"prompt": "Hi", "repetition_penalty": math.nan, "logprobs": 2}, "repetition_penalty"),
        ({"prompt": "Hi", "repetition_penalty": math.nan, "logprobs": 2, "stream": True}, "repetition_penalty"),
        ({"prompt": "Hi", "temperature": 2.5}, "temperature"),
        ({"prompt": "Hi", "temperature": math.inf}, "temperature"),
        ({"prompt": "Hi", "temperature": math.nan}, "temperature"),
        ({"prompt": "Hi", "presence_penalty": -math.inf}, "presence_penalty"),
        ({"prompt": "Hi", "stop": ["a", "b", "c", "d", "e"]}, "stop"),
        ({"prompt": "Hi", "stream_options": {"include_usage": True}}, None),
        ({"prompt": "Hi", "stop_token_ids": [2**40]}, "stop_token_ids"),
        ({"prompt": "Hi", "max_tokens": 2**40}, "max_tokens"),
        ({"prompt": "Hi", "min_tokens": 2**40}, "min_tokens"),
    ],
)
def test_out_of_range_completion_fields_are_400(agg_router, script, body, param):
    error = assert_error(post_raw(agg_router, "/v1/completions", body), 400)
    if param is not None:
        assert error["param"] == param and param in error["message"]
    else:
        assert "stream_options" in error["message"]


@pytest.mark.parametrize(
    "body, param",
    [
        ({"messages": [{"role": "wizard", "content": "hi"}]}, "messages"),
        ({"messages": MESSAGES, "top_logprobs": 21, "logprobs": True}, "top_logprobs"),
        ({"messages": MESSAGES, "temperature": 3}, "temperature"),
    ],
)
def test_refused_chat_fields_are_400(agg_router, script, body, param):
    assert_error(post_raw(agg_router, "/v1/chat/completions", body), 400, param=param)


def test_choice_seeds_wrap_within_int64():
    params = SamplingParams(seed=2**63 - 1)
    assert choice_params(params, 1).seed == -(2**63)  # seed + index stays a valid int64
    assert choice_params(params, 0).seed == 2**63 - 1


def test_405_names_the_allowed_methods(agg_router):
    resp = httpx.get(f"{agg_router.url}/v1/completions", timeout=10)
    assert_error(resp, 405)
    assert resp.headers["allow"] == "POST"


def test_openapi_documents_what_the_router_answers(agg_router):
    schema = httpx.get(f"{agg_router.url}/openapi.json", timeout=10).json()
    assert "422" not in json.dumps(schema)
    for path in ("/v1/completions", "/v1/chat/completions"):
        responses = schema["paths"][path]["post"]["responses"]
        assert {"200", "400", "404", "413", "503"} <= set(responses)
        assert "text/event-stream" in responses["200"]["content"]
    fields = schema["components"]["schemas"]["CompletionRequest"]["properties"]
    temperature = [t for t in fields["temperature"]["anyOf"] if t.get("type") == "number"][0]
    assert (temperature["minimum"], temperature["maximum"]) == (0, 2)
    top_k = [t for t in fields["top_k"]["anyOf"] if t.get("type") == "integer"][0]
    assert top_k["maximum"] == 2**31 - 1


def test_non_finite_logprobs_never_reach_json():
    assert _lp(math.nan) == MIN_LOGPROB and _lp(-math.inf) == MIN_LOGPROB and _lp(-0.5) == -0.5
    with pytest.raises(ValueError):
        sse({"logprob": math.nan})


@pytest.mark.parametrize(
    "field, value",
    [("temperature", math.nan), ("repetition_penalty", math.nan), ("top_k", 2**31), ("seed", 2**63)],
)
def test_the_engine_refuses_what_the_edge_refuses(field, value):
    with pytest.raises(InvalidRequestError, match=field):
        SamplingParams(**{field: value})
