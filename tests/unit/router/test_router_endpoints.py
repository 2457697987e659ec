"""The small endpoints: one model card, tokenize / detokenize, load, version."""

from __future__ import annotations

import threading

import httpx
import openai
import pytest

MODEL = "tiny-test"
MESSAGES = [{"role": "user", "content": "Hello"}]


def test_model_card_and_openai_shaped_404(agg_router):
    client = openai.OpenAI(base_url=f"{agg_router.url}/v1", api_key="x")
    card = client.models.retrieve(MODEL)
    assert card.id == MODEL and card.object == "model"
    with pytest.raises(openai.NotFoundError) as info:
        client.models.retrieve("no-such-model")
    assert info.value.body["code"] == "model_not_found" and info.value.body["param"] == "model"


def test_tokenize_prompt_and_messages(agg_router, tokenizer):
    body = httpx.post(f"{agg_router.url}/tokenize", json={"prompt": "Hello there", "return_token_strs": True}).json()
    ids = tokenizer.encode("Hello there")
    assert body["tokens"] == ids and body["count"] == len(ids) and body["max_model_len"] == 256
    assert body["token_strs"] == [tokenizer.id_to_token(t) for t in ids]
    plain = httpx.post(f"{agg_router.url}/tokenize", json={"prompt": "Hi", "add_special_tokens": False}).json()
    assert plain["tokens"] == tokenizer.encode("Hi", add_special_tokens=False) and plain["token_strs"] is None
    chat = httpx.post(f"{agg_router.url}/tokenize", json={"model": MODEL, "messages": MESSAGES}).json()
    rendered = tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True)
    assert chat["tokens"] == tokenizer.encode(rendered, add_special_tokens=False)


@pytest.mark.parametrize(
    "path, body, param",
    [
        ("/tokenize", {}, "prompt"),
        ("/tokenize", {"prompt": "a", "messages": MESSAGES}, "prompt"),
        ("/tokenize", {"prompt": "a", "frobnicate": 1}, "frobnicate"),
        ("/detokenize", {"tokens": [1, 10**6]}, "tokens"),
        ("/detokenize", {"tokens": "abc"}, "tokens"),
    ],
)
def test_tokenizer_endpoint_errors(agg_router, path, body, param):
    response = httpx.post(f"{agg_router.url}{path}", json=body)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param


def test_detokenize_round_trips(agg_router, tokenizer):
    ids = tokenizer.encode("Caf\u00e9 \u4e16\u754c!", add_special_tokens=False)
    body = httpx.post(f"{agg_router.url}/detokenize", json={"model": MODEL, "tokens": ids}).json()
    assert body == {"prompt": "Caf\u00e9 \u4e16\u754c!"}
    wrong = httpx.post(f"{agg_router.url}/detokenize", json={"model": "other", "tokens": ids})
    assert wrong.status_code == 404


def test_load_counts_requests_in_flight(agg_router, script, eventually):
    script.delay_s = 0.05
    assert httpx.get(f"{agg_router.url}/load").json() == {"server_load": 0}
    done = threading.Event()

    def slow_request() -> None:
        httpx.post(f"{agg_router.url}/v1/completions", json={"prompt": "Hi", "max_tokens": 40}, timeout=60)
        done.set()

    threading.Thread(target=slow_request, daemon=True).start()
    assert eventually(lambda: httpx.get(f"{agg_router.url}/load").json()["server_load"] == 1, 20)
    assert done.wait(60)
    assert eventually(lambda: httpx.get(f"{agg_router.url}/load").json()["server_load"] == 0, 20)


def test_version(agg_router):
    version = httpx.get(f"{agg_router.url}/version").json()["version"]
    assert version and version[0].isdigit()


@pytest.mark.parametrize(
    "body, param",
    [
        ({"input": ""}, "input"),
        ({"input": []}, "input"),
        ({"input": [1, 10**6]}, "input"),
        ({"input": "hi", "dimensions": 7}, "dimensions"),
        ({"input": "hi", "encoding_format": "int8"}, "encoding_format"),
        ({"input": "hi", "pooling": "max"}, "pooling"),
        ({"input": "hi", "frobnicate": 1}, "frobnicate"),
        ({"input": "hi " * 300}, "input"),
    ],
)
def test_embedding_errors_name_the_field(agg_router, script, body, param):
    response = httpx.post(f"{agg_router.url}/v1/embeddings", json={"model": MODEL, **body})
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param
    assert not script.generate_requests
