"""A sample of a fork (n > 1) cut at a stop string is ended on its worker at once.

The scripted decode worker (no GPU engine needed for the routing logic) streams
the samples one after another and records the Abort calls it gets.
"""

from __future__ import annotations

import httpx

from tests.unit.router.conftest import MODEL_NAME as MODEL


def test_a_sample_cut_at_a_stop_string_is_stopped_on_the_worker(agg_router, script, tokenizer, eventually):
    body = {"model": MODEL, "prompt": "Hi", "max_tokens": 40, "n": 2, "stop": "client."}
    response = httpx.post(f"{agg_router.url}/v1/completions", json=body, timeout=60).json()
    assert [c["finish_reason"] for c in response["choices"]] == ["stop", "stop"]
    request_id = script.generate_requests[0].request_id
    # Sample 0 was cut while the worker still streamed it: the router asked for that sample alone.
    assert eventually(lambda: request_id in script.aborted_samples)
    assert f"{request_id}/1" not in script.aborted_samples or request_id in script.aborted


def test_a_single_sample_request_is_never_cut_as_a_sample(agg_router, script, eventually):
    body = {"model": MODEL, "prompt": "Hi", "max_tokens": 40, "stop": "client."}
    assert httpx.post(f"{agg_router.url}/v1/completions", json=body, timeout=60).status_code == 200
    request_id = script.generate_requests[0].request_id
    assert eventually(lambda: request_id in script.aborted)
    assert script.aborted_samples == []
