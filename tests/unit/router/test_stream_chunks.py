"""Stream chunks of plain deltas are rendered from a per-choice template (serving.ChunkTemplate); each one must
be exactly the event the chunk models would give, for any text and finish reason."""

from __future__ import annotations

import json

import pytest

from services.router.generation import ChoiceDelta, ChoiceSpec
from services.router.serving import ChatFormat, CompletionFormat, Prepared, sse

TEXTS = ["", "a", ' "quoted"\\ and\nnewline\t', "é 😀 \u2028 \u2063cleave-text", "\x00\x1f", "}]},{"]


def prepared(include_usage: bool, num_choices: int = 3) -> Prepared:
    specs = [ChoiceSpec(i, f"cmpl-t-{i}", [1, 2, 3], None) for i in range(num_choices)]  # type: ignore[arg-type]
    return Prepared("cmpl-t", [[1, 2, 3]], specs, stream=True, include_usage=include_usage)


@pytest.mark.parametrize("include_usage", [False, True])
@pytest.mark.parametrize("make_format", [CompletionFormat, ChatFormat])
def test_templated_chunks_are_the_models_chunks(make_format, include_usage):
    fast, slow = make_format(prepared(include_usage), "m"), make_format(prepared(include_usage), "m")
    slow.created = fast.created
    assert fast.state.plain
    slow.state.plain = False  # the chunk models, as for a request that asks for more
    templated = 0
    for index in (0, 2):
        for text in TEXTS:
            for finish in (None, "stop", "length"):
                for num_tokens in (0, 1, 2):
                    delta = ChoiceDelta(index, text, num_tokens, finish_reason=finish)
                    expected, got = slow.delta_chunk(delta), fast.delta_chunk(delta)
                    if expected is None:
                        assert got is None
                        continue
                    assert sse(got) == sse(expected)
                    # Chat's delta without content (no text, no token: a bare finish) keeps the model.
                    templated += isinstance(got, str)
                    choice = json.loads(sse(got).removeprefix("data: "))["choices"][0]
                    assert choice["index"] == index and choice["finish_reason"] == finish
                    content = choice["text"] if make_format is CompletionFormat else choice["delta"].get("content")
                    assert content == (text if text or num_tokens or make_format is CompletionFormat else None)
    assert templated >= 2 * (len(TEXTS) * 3 * 3 - 3)
    assert fast.state.num_generated == slow.state.num_generated > 0


@pytest.mark.parametrize(
    "change", [{"return_token_ids": True}, {"prompt_logprobs": True}, {"continuous_usage": True}, {"echo_texts": ["p"]}]
)
def test_requests_that_ask_for_more_use_the_models(change):
    prep = prepared(include_usage=True)
    for key, value in change.items():
        setattr(prep, key, value)
    assert not CompletionFormat(prep, "m").state.plain and not ChatFormat(prep, "m").state.plain
