"""Migration against scripted decode workers: a forked stream that breaks mid-generation goes on as
one single-sample request per unfinished sample (its seed, its tokens so far) on another worker, and
every choice ends with the text of an uninterrupted run. Beam search already sent is not re-run."""

from __future__ import annotations

import socket

import httpx
import pytest

from tests.unit.router.conftest import read_sse

MODEL = "tiny-test"
MAX_TOKENS = 6


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(params=["aggregated", "disaggregated"])
def two_decodes(request, router_factory, worker_addrs, start_decode_worker, script):
    decodes = [worker_addrs["decode"], start_decode_worker(free_port())]
    return router_factory(prefill=request.param == "disaggregated", decode=decodes)


def complete(router, body: dict, stream: bool) -> tuple[int, dict[int, str], str]:
    """(status, text per choice index, x-request-id)."""
    body = {"model": MODEL, "prompt": "Hi", "max_tokens": MAX_TOKENS, "ignore_eos": True, **body, "stream": stream}
    with httpx.Client(base_url=router.url, timeout=30) as client:
        with client.stream("POST", "/v1/completions", json=body) as response:
            if not stream or response.status_code != 200:
                response.read()
                texts = {c["index"]: c["text"] for c in response.json().get("choices", [])}
                return response.status_code, texts, response.headers["x-request-id"]
            texts = {}
            for event in read_sse(response):
                for choice in event["choices"] if isinstance(event, dict) and "choices" in event else []:
                    texts[choice["index"]] = texts.get(choice["index"], "") + choice["text"]
            return response.status_code, texts, response.headers["x-request-id"]


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("seed", [5, None])
def test_a_broken_fork_goes_on_sample_by_sample(two_decodes, script, tokenizer, stream, seed):
    script.break_after = 4  # the fork streams sample 0 first: 4 of its tokens reach the client
    status, texts, request_id = complete(two_decodes, {"n": 3, "temperature": 1.0, "seed": seed}, stream)
    assert status == 200
    first = 0 if seed is None else seed
    assert texts == {i: tokenizer.decode(script.ids(MAX_TOKENS, seed=first + i if seed is not None else 0))
                     for i in range(3)}  # fmt: skip
    fork, *singles = script.generate_requests
    assert fork.sampling.n == 3 and fork.request_id == f"{request_id}-0"
    moved = {r.request_id: r for r in singles}
    assert sorted(moved) == [f"{request_id}-0", f"{request_id}-0/1", f"{request_id}-0/2"]
    for index, request in enumerate(moved[k] for k in sorted(moved)):
        assert request.sampling.n == 1
        assert list(request.generated_token_ids) == (script.ids(4, seed=first) if index == 0 else [])
        if seed is None:
            assert not request.sampling.HasField("seed")
        else:
            assert request.sampling.seed == seed + index


def test_beam_search_already_sent_ends_with_the_error(two_decodes, script):
    script.break_after = 2
    body = {"use_beam_search": True, "n": 2, "best_of": 2, "temperature": 0}
    status, _, _ = complete(two_decodes, body, stream=False)
    assert status == 503
    assert len(script.generate_requests) == 1  # not run again: part of it had reached the client


def test_migrated_samples_cut_at_a_stop_string_are_ended_on_their_worker(two_decodes, script, tokenizer, eventually):
    script.break_after = 3
    body = {"n": 2, "seed": 3, "temperature": 1.0, "stop": "client.", "max_tokens": 40}
    status, texts, request_id = complete(two_decodes, body, stream=True)
    assert status == 200
    for index in range(2):
        full = tokenizer.decode(script.ids(40, seed=3 + index))
        assert texts[index] == full[: full.index("client.")]
    singles = [r.request_id for r in script.generate_requests[1:]]
    assert sorted(singles) == [f"{request_id}-0", f"{request_id}-0/1"]
    ended = lambda: all(s in script.aborted or s in script.cancelled for s in singles)  # noqa: E731
    assert eventually(ended)


def test_without_migration_a_broken_fork_ends_with_the_error(router_factory, worker_addrs, start_decode_worker,
                                                              script):  # fmt: skip
    decodes = [worker_addrs["decode"], start_decode_worker(free_port())]
    router = router_factory(prefill=False, decode=decodes, migration_limit=0)
    script.break_after = 2
    status, _, _ = complete(router, {"n": 3, "seed": 1, "temperature": 1.0}, stream=False)
    assert status == 503
    assert len(script.generate_requests) == 1
