"""Tool-call parsers and plans (pure router code)."""

from __future__ import annotations

import json

import pytest

from services.router.structured import ConstraintError
from services.router.tools import (
    ToolCallStream,
    ToolFields,
    extract_tool_calls,
    parse_hermes,
    parse_llama3_json,
    plan_tools,
)

FUNCS = {"get_weather": {"type": "object"}, "get_time": {"type": "object"}}
TOOLS = [{"type": "function", "function": {"name": n, "parameters": p}} for n, p in FUNCS.items()]


def test_hermes_calls_and_content():
    text = 'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>' \
           '<tool_call>{"name": "get_time", "arguments": {}}</tool_call>'  # fmt: skip
    content, calls = parse_hermes(text, FUNCS)
    assert content == "Let me check."
    assert [c["function"]["name"] for c in calls] == ["get_weather", "get_time"]
    assert json.loads(calls[0]["function"]["arguments"]) == {"city": "Oslo"}
    assert len({c["id"] for c in calls}) == 2


def test_hermes_ignores_unknown_or_broken_calls():
    assert parse_hermes('<tool_call>{"name": "rm", "arguments": {}}</tool_call>', FUNCS)[1] == []
    assert parse_hermes("<tool_call>{broken</tool_call>", FUNCS)[1] == []
    assert parse_hermes("just text", FUNCS) == ("just text", [])


def test_llama3_json():
    content, calls = parse_llama3_json('<|python_tag|>{"name": "get_time", "parameters": {"zone": "UTC"}}', FUNCS)
    assert content == "" and json.loads(calls[0]["function"]["arguments"]) == {"zone": "UTC"}
    two = '{"name": "get_time", "parameters": {}}; {"name": "get_weather", "parameters": {"city": "Paris"}}'
    assert [c["function"]["name"] for c in parse_llama3_json(two, FUNCS)[1]] == ["get_time", "get_weather"]
    assert parse_llama3_json("The weather is fine.", FUNCS) == ("The weather is fine.", [])


def test_plans_and_their_grammars():
    named = plan_tools(
        ToolFields(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "get_time"}}), None
    )
    assert named is not None and named.mode == "named"
    assert named.constraint().kind == "json"  # type: ignore[union-attr]
    required = plan_tools(ToolFields(tools=TOOLS, tool_choice="required", parallel_tool_calls=False), None)
    assert required is not None
    schema = json.loads(required.constraint().spec)  # type: ignore[union-attr]
    assert schema["maxItems"] == 1 and len(schema["items"]["anyOf"]) == 2
    assert plan_tools(ToolFields(tools=TOOLS, tool_choice="none"), None) is None
    assert plan_tools(ToolFields(tools=TOOLS), "hermes").mode == "auto"  # type: ignore[union-attr]
    with pytest.raises(ConstraintError, match="--tool-call-parser"):
        plan_tools(ToolFields(tools=TOOLS), None)


def test_required_output_and_stream_reassembly():
    plan = plan_tools(ToolFields(tools=TOOLS, tool_choice="required"), None)
    assert plan is not None
    text = '[{"name": "get_time", "parameters": {"zone": "UTC"}}, {"name": "get_weather", "parameters": {}}]'
    content, calls = extract_tool_calls(plan, text)
    assert content is None and [c["function"]["name"] for c in calls] == ["get_time", "get_weather"]
    stream = ToolCallStream(plan)
    parts = stream.add(text[:10], False) + stream.add(text[10:], True)
    assert stream.num_calls == 2
    names = [p.tool_calls[0]["function"].get("name") for p in parts if p.tool_calls and "id" in p.tool_calls[0]]
    assert names == ["get_time", "get_weather"]


# A Qwen-style template reduced to what the test reads: tools, assistant calls and tool results.
TOOL_TEMPLATE = (
    "{% if tools %}TOOLS:{% for t in tools %}{{ t.function.name }};{% endfor %}\n{% endif %}"
    "{% for m in messages %}<{{ m.role }}>"
    "{% if m.tool_calls %}{% for c in m.tool_calls %}CALL {{ c.function.name }} {{ c.function.arguments.city }}"
    "{% endfor %}{% elif m.role == 'tool' %}RESULT {{ m.tool_call_id }}={{ m.content }}{% else %}{{ m.content }}{% endif %}"
    "\n{% endfor %}<assistant>"
)


def test_tools_and_tool_history_reach_the_template(checkpoint_factory, tmp_path):
    from services.router.protocol import ChatCompletionRequest
    from services.router.serving import chat_prompt
    from shared.tokenizer import Tokenizer

    source = checkpoint_factory("llama")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (tmp_path / name).write_bytes((source / name).read_bytes())
    (tmp_path / "chat_template.jinja").write_text(TOOL_TEMPLATE)
    tokenizer = Tokenizer.from_dir(tmp_path)
    req = ChatCompletionRequest(
        messages=[
            {"role": "user", "content": "weather?"},
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}
            ]},
            {"role": "tool", "tool_call_id": "call_1", "content": "rain"},
        ],
        tools=TOOLS,
    )  # fmt: skip
    text = tokenizer.decode(chat_prompt(req, tokenizer), skip_special_tokens=False)
    # Block tags eat the newline after them (trim_blocks, as in transformers).
    expected = (
        "TOOLS:get_weather;get_time;<user>weather?<assistant>CALL get_weather Oslo<tool>RESULT call_1=rain<assistant>"
    )
    assert text == expected
