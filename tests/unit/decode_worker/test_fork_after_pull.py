"""A fork after a pull drops the prefill's one first token and recomputes the last prompt position."""

from __future__ import annotations

from services.decode_worker.fork import resample_first_token
from shared.engine.request import Request
from shared.engine.sampling_params import SamplingParams

BLOCK_SIZE = 4


def pulled_request(num_prompt_tokens: int) -> Request:
    request = Request("r", list(range(10, 10 + num_prompt_tokens)), SamplingParams(n=3))
    request.append_output_token(99)  # the prefill worker's first token
    request.block_hashes(BLOCK_SIZE)  # hashes may already cover it
    return request


def test_admit_joins_with_the_last_prompt_position_to_compute():
    request = pulled_request(7)  # 7 prompt tokens + 1: the dropped token filled block 1
    joined = []

    def admit(r: Request) -> None:  # what the pull's join does: every prompt token's KV is in place
        r.num_computed_tokens = r.num_tokens
        joined.append(r)

    wrapped = resample_first_token(request, admit, BLOCK_SIZE)
    assert request.output_token_ids == [] and request.token_ids == request.prompt_token_ids
    assert len(request._block_hashes) == 1  # the hash over the dropped token is gone
    assert wrapped is not None
    wrapped(request)
    assert joined == [request] and request.num_computed_tokens == 6  # one token to compute, then n samples
    assert request.block_hashes(BLOCK_SIZE) == pulled_request(7).block_hashes(BLOCK_SIZE)[:1]


def test_failed_pull_leaves_a_plain_request_to_prefill_here():
    request = pulled_request(5)
    assert resample_first_token(request, None, BLOCK_SIZE) is None
    assert request.num_tokens == 5 and request.num_computed_tokens == 0


def test_structured_output_restarts_from_a_fresh_matcher():
    request = pulled_request(5)
    request.matcher = advanced = object()  # stands for a grammar matcher that accepted the dropped token
    fresh = object()
    resample_first_token(request, None, BLOCK_SIZE, fresh)
    assert request.matcher is fresh and request.matcher is not advanced
