"""API key, 429 backpressure with Retry-After and the whole-request deadline, against scripted workers."""

from __future__ import annotations

import threading
import time

import httpx
import pytest

from shared.tools.smoke import smoke
from tests.unit.router.conftest import MODEL_NAME


def post(router, body: dict, headers: dict | None = None) -> httpx.Response:
    return httpx.post(f"{router.url}/v1/completions", json={"model": MODEL_NAME, **body}, headers=headers, timeout=30)


def test_api_key_accepted_refused_and_absent(router_factory, script):
    router = router_factory(prefill=False, api_key="s3cret")
    ok = post(router, {"prompt": "Hi", "max_tokens": 2}, {"Authorization": "Bearer s3cret"})
    assert ok.status_code == 200
    wrong = post(router, {"prompt": "Hi", "max_tokens": 2}, {"Authorization": "Bearer nope"})
    assert wrong.status_code == 401 and wrong.json()["error"]["code"] == "invalid_api_key"
    absent = post(router, {"prompt": "Hi", "max_tokens": 2})
    assert absent.status_code == 401 and "Authorization: Bearer" in absent.json()["error"]["message"]
    assert absent.headers["www-authenticate"] == "Bearer"
    streamed = post(router, {"prompt": "Hi", "max_tokens": 3, "stream": True}, {"Authorization": "Bearer s3cret"})
    assert streamed.status_code == 200 and streamed.text.count("data: {") == 3 and streamed.text.endswith("[DONE]\n\n")
    assert post(router, {"prompt": "Hi", "max_tokens": 3, "stream": True}).status_code == 401
    assert httpx.get(f"{router.url}/v1/models").status_code == 401
    assert httpx.get(f"{router.url}/health").status_code == 200
    assert httpx.get(f"{router.url}/metrics").status_code == 200


def test_429_with_retry_after_when_every_worker_is_full(router_factory, script):
    router = router_factory(prefill=False, max_queued_requests=1)
    script.delay_s = 0.05  # per message: the first request stays in flight for a while
    results: list[int] = []
    first = threading.Thread(
        target=lambda: results.append(post(router, {"prompt": "Hi", "max_tokens": 40}).status_code)
    )
    first.start()
    deadline = time.monotonic() + 10
    while router.state.pools.decode.workers[0].num_in_flight == 0:
        assert time.monotonic() < deadline, "the first request never reached the worker"
        time.sleep(0.01)
    refused = post(router, {"prompt": "Hi", "max_tokens": 2})
    assert refused.status_code == 429
    assert refused.headers["retry-after"] == "1"
    assert refused.json()["error"]["code"] == "rate_limit_exceeded"
    first.join(timeout=30)
    assert results == [200]
    # Room again once a load poll (every 0.5 s here) shows the worker's queue empty.
    deadline = time.monotonic() + 10
    while (status := post(router, {"prompt": "Hi", "max_tokens": 2}).status_code) == 429:
        assert time.monotonic() < deadline, "still refused after the worker's queue emptied"
        time.sleep(0.1)
    assert status == 200


@pytest.mark.parametrize("stream", [False, True])
def test_request_timeout(router_factory, script, stream):
    router = router_factory(prefill=False, request_timeout_s=0.5)
    script.delay_s = 0.1
    start = time.monotonic()
    response = post(router, {"prompt": "Hi", "max_tokens": 100, "stream": stream})
    assert time.monotonic() - start < 5
    if stream:
        assert response.status_code == 200
        assert "--request-timeout" in response.text and response.text.rstrip().endswith("data: [DONE]")
    else:
        assert response.status_code == 504 and "--request-timeout" in response.json()["error"]["message"]


def test_smoke_check_sends_the_api_key(router_factory, script):
    router = router_factory(prefill=False, api_key="s3cret")
    assert smoke(router.url, 5.0, "s3cret")
    with pytest.raises(SystemExit, match="401"):
        smoke(router.url, 0.0, None)
