"""A bug in one choice's task (an unexpected exception) ends the whole request at once: a 500 in the
OpenAI error shape, or an error event then ``[DONE]`` in a stream; the other choices' worker calls are
aborted. Nothing waits for a choice that will never report."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest

from services.router import generation
from tests.unit.router.conftest import read_sse

MODEL = "tiny-test"
BODY = {"model": MODEL, "prompt": ["Hi", "Yo"], "max_tokens": 100, "ignore_eos": True}
DEADLINE_S = 10.0


class Injected(RuntimeError):
    pass


@pytest.fixture
def failing_decoder(monkeypatch, script):
    """Choice 1's decoder raises at its third token; choice 0 goes on slowly (its call must be aborted)."""
    script.delay_s = 0.02
    add = generation.ChoiceDecoder.add

    def add_or_fail(self, response):
        if self.spec.index == 1 and self.num_tokens >= 2:
            raise Injected("injected failure in a choice's formatter")
        return add(self, response)

    monkeypatch.setattr(generation.ChoiceDecoder, "add", add_or_fail)


@pytest.fixture
def cancelled_inside(monkeypatch, script):
    """Choice 1's task ends cancelled without anyone cancelling it (a BaseException, not an Exception)."""
    script.delay_s = 0.02
    add = generation.ChoiceDecoder.add

    def add_or_cancel(self, response):
        if self.spec.index == 1 and self.num_tokens >= 2:
            raise asyncio.CancelledError()
        return add(self, response)

    monkeypatch.setattr(generation.ChoiceDecoder, "add", add_or_cancel)


@pytest.fixture
def failing_setup(monkeypatch, script):
    """Choice 1 fails before its worker call starts, while making its decoder."""
    script.delay_s = 0.02
    post_init = generation.ChoiceDecoder.__post_init__

    def post_init_or_fail(self):
        if self.spec.index == 1:
            raise Injected("injected failure while setting up a choice")
        post_init(self)

    monkeypatch.setattr(generation.ChoiceDecoder, "__post_init__", post_init_or_fail)


def assert_server_error(body: dict) -> None:
    assert set(body) == {"error"}
    assert set(body["error"]) == {"message", "type", "param", "code"}
    assert body["error"]["type"] == "server_error"


def post(router, stream: bool) -> tuple[httpx.Response, list, float]:
    start = time.monotonic()
    with httpx.Client(base_url=router.url, timeout=DEADLINE_S) as client:
        with client.stream("POST", "/v1/completions", json={**BODY, "stream": stream}) as response:
            events = read_sse(response) if response.status_code == 200 and stream else []
            if not events:
                response.read()
    return response, events, time.monotonic() - start


def aborted_choice_zero(script, response) -> bool:
    return f"{response.headers['x-request-id']}-0" in script.aborted


@pytest.mark.parametrize("failure", ["failing_decoder", "cancelled_inside", "failing_setup"])
@pytest.mark.parametrize("routing", ["router", "agg_router"])
def test_a_failing_choice_ends_the_answer_with_a_500(request, failure, routing, script, eventually):
    request.getfixturevalue(failure)
    router = request.getfixturevalue(routing)
    response, _, elapsed = post(router, stream=False)
    assert response.status_code == 500, response.text
    assert_server_error(response.json())
    assert elapsed < DEADLINE_S / 2
    assert eventually(lambda: aborted_choice_zero(script, response))


@pytest.mark.parametrize("failure", ["failing_decoder", "cancelled_inside", "failing_setup"])
def test_a_failing_choice_ends_the_stream_with_an_error_event(request, failure, router, script, eventually):
    request.getfixturevalue(failure)
    response, events, elapsed = post(router, stream=True)
    assert elapsed < DEADLINE_S / 2
    if response.status_code == 500:  # the failure came before the first token: no stream was opened
        assert failure == "failing_setup"
        assert_server_error(response.json())
    else:
        assert events[-1] == "[DONE]"
        assert_server_error(events[-2])
        assert all("choices" in event for event in events[:-2])
    assert eventually(lambda: aborted_choice_zero(script, response))
