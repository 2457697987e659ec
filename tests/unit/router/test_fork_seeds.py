"""The samples of a forked request get seeds that stay inside int64, also at the edge of the range."""

from __future__ import annotations

from services.router.generation import ChoiceSpec, fork_children
from shared.engine.sampling_params import SamplingParams

INT64_MAX = 2**63 - 1


def test_fork_children_seeds_wrap_within_int64() -> None:
    spec = ChoiceSpec(0, "cmpl-x", [1, 2, 3], SamplingParams(n=3, seed=INT64_MAX, temperature=1.0, max_tokens=4))
    children = fork_children(spec)
    assert [c.request_id for c in children] == ["cmpl-x", "cmpl-x/1", "cmpl-x/2"]
    assert [c.params.seed for c in children] == [INT64_MAX, -(2**63), -(2**63) + 1]
    assert all(c.params.n == 1 for c in children)
