"""Tool calling at the HTTP edge: request fields, the grammar that enforces a forced
call, parsers for a model's own tool-call syntax, and the OpenAI response shapes.

``tool_choice``: ``none`` (tools only reach the template), ``auto`` (the model's
text is parsed with ``--tool-call-parser``), ``required`` (a grammar forces a
JSON list of one or more ``{"name", "parameters"}`` calls) or a named function
(a grammar forces that function's arguments object).
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict

from services.router.structured import ConstraintError, json_constraint
from shared.structured.constraint import Constraint

ANY_OBJECT: dict[str, Any] = {"type": "object"}


class _Fields(BaseModel):
    model_config = ConfigDict(extra="ignore")


class FunctionDefinition(_Fields):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ToolDefinition(_Fields):
    type: Literal["function"] = "function"
    function: FunctionDefinition


class FunctionName(_Fields):
    name: str


class NamedToolChoice(_Fields):
    type: Literal["function"] = "function"
    function: FunctionName


class ToolFields(_Fields):
    """Mixed into the chat request model."""

    tools: list[ToolDefinition] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None

    def template_tools(self) -> list[dict[str, Any]] | None:
        """Tools as the chat template receives them (transformers' ``apply_chat_template(tools=...)``)."""
        if not self.tools:
            return None
        return [t.model_dump(exclude_none=True) for t in self.tools]


@dataclass(frozen=True)
class ToolPlan:
    mode: str  # "named", "required" or "auto"
    functions: dict[str, dict[str, Any]]  # name -> parameters schema
    parser: str | None
    parallel: bool
    forced_name: str | None = None

    def constraint(self) -> Constraint | None:
        """The grammar of a forced call; None for ``auto``."""
        if self.mode == "named":
            assert self.forced_name is not None
            return json_constraint(self.functions[self.forced_name], "tools")
        if self.mode == "required":
            calls = [
                {
                    "type": "object",
                    "properties": {"name": {"enum": [name]}, "parameters": params},
                    "required": ["name", "parameters"],
                }
                for name, params in self.functions.items()
            ]
            schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": calls}}
            if not self.parallel:
                schema["maxItems"] = 1
            return json_constraint(schema, "tools")
        return None


def plan_tools(req: ToolFields, parser: str | None) -> ToolPlan | None:
    """What the request's tool fields ask for; None when no call can come back. ConstraintError if invalid."""
    choice = req.tool_choice
    if not req.tools:
        if choice not in (None, "none"):
            raise ConstraintError("tool_choice needs tools", "tool_choice")
        return None
    functions: dict[str, dict[str, Any]] = {}
    for tool in req.tools:
        if tool.function.name in functions:
            raise ConstraintError(f"tools: function {tool.function.name!r} is defined twice", "tools")
        functions[tool.function.name] = tool.function.parameters or ANY_OBJECT
    parallel = req.parallel_tool_calls is not False
    if choice == "none":
        return None
    if isinstance(choice, NamedToolChoice):
        if choice.function.name not in functions:
            raise ConstraintError(f"tool_choice names {choice.function.name!r}, which is not in tools", "tool_choice")
        return ToolPlan("named", functions, parser, parallel, choice.function.name)
    if choice == "required":
        return ToolPlan("required", functions, parser, parallel)
    if parser is None:
        raise ConstraintError(
            "tool_choice 'auto' needs the router started with --tool-call-parser (hermes or llama3_json); "
            "or send tool_choice 'required', 'none' or a named function",
            "tool_choice",
        )
    return ToolPlan("auto", functions, parser, parallel)


def make_call(name: str, arguments: Any) -> dict[str, Any]:
    """One OpenAI ``tool_calls`` entry; ``arguments`` always travels as a JSON string."""
    text = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function", "function": {"name": name, "arguments": text}}


_HERMES = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)


def parse_hermes(text: str, functions: dict[str, Any]) -> tuple[str, list[dict[str, Any]]]:
    """``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` blocks (Qwen, Hermes); the rest is content."""
    calls = []
    for body in _HERMES.findall(text):
        call = _call_from_json(body, "arguments", functions)
        if call is not None:
            calls.append(call)
    if not calls:
        return text, []
    return _HERMES.sub("", text).strip(), calls


def parse_llama3_json(text: str, functions: dict[str, Any]) -> tuple[str, list[dict[str, Any]]]:
    """Llama 3's JSON calls: ``{"name": ..., "parameters": {...}}``, several joined by ``;``."""
    body = text.strip().removeprefix("<|python_tag|>").strip()
    if not body.startswith("{"):
        return text, []
    calls = []
    for part in body.split(";"):
        call = _call_from_json(part, "parameters", functions)
        if call is None:
            return text, []
        calls.append(call)
    return "", calls


def _call_from_json(body: str, key: str, functions: dict[str, Any]) -> dict[str, Any] | None:
    try:
        value = json.loads(body)
    except json.JSONDecodeError:
        return None
    if not isinstance(value, dict) or value.get("name") not in functions:
        return None
    arguments = value.get(key, value.get("arguments", value.get("parameters", {})))
    return make_call(value["name"], arguments)


PARSERS = {"hermes": parse_hermes, "llama3_json": parse_llama3_json}


def extract_tool_calls(plan: ToolPlan, text: str) -> tuple[str | None, list[dict[str, Any]]]:
    """(content, tool_calls) of a finished choice's text."""
    if plan.mode == "named":
        assert plan.forced_name is not None
        return None, [make_call(plan.forced_name, text)]
    if plan.mode == "required":
        try:
            items = json.loads(text)
        except json.JSONDecodeError:
            return text, []  # cut short by max_tokens: no complete call to return
        return None, [make_call(item["name"], item["parameters"]) for item in items]
    assert plan.parser is not None
    content, calls = PARSERS[plan.parser](text, plan.functions)
    return (content or None) if calls else text, calls


def message_for_template(message: Any) -> dict[str, Any]:
    """History entries a template can read: assistant ``tool_calls`` with arguments as objects."""
    entry: dict[str, Any] = {}
    if message.tool_calls:
        calls = []
        for call in message.tool_calls:
            function = dict(call.get("function") or {})
            arguments = function.get("arguments")
            if isinstance(arguments, str):
                try:
                    function["arguments"] = json.loads(arguments)
                except json.JSONDecodeError:
                    pass
            calls.append({**call, "function": function, **function})
        entry["tool_calls"] = calls
    if message.tool_call_id is not None:
        entry["tool_call_id"] = message.tool_call_id
    return entry


@dataclass
class ToolDelta:
    """One stream delta of a tool-calling choice: content, or tool-call fragments in the stream shape."""

    content: str | None = None
    tool_calls: list[dict[str, Any]] | None = None


class ToolCallStream:
    """Turns one choice's text deltas into OpenAI stream deltas: a call's id and name first, then
    its argument fragments. A named call streams its arguments as they are generated; ``required``
    and ``auto`` answers are read whole when the choice ends (a parse needs the complete text)."""

    def __init__(self, plan: ToolPlan) -> None:
        self.plan = plan
        self.text = ""
        self.opened = False
        self.num_calls = 1 if plan.mode == "named" else 0

    def add(self, text: str, finished: bool) -> list[ToolDelta]:
        self.text += text
        if self.plan.mode == "named":
            out = []
            if not self.opened and (text or finished):
                self.opened = True
                assert self.plan.forced_name is not None
                header = make_call(self.plan.forced_name, "")
                out.append(ToolDelta(tool_calls=[{"index": 0, **header}]))
            if text:
                out.append(ToolDelta(tool_calls=[{"index": 0, "function": {"arguments": text}}]))
            return out
        if not finished:
            return []
        content, calls = extract_tool_calls(self.plan, self.text)
        self.num_calls = len(calls)
        out = [ToolDelta(content=content)] if content else []
        for index, call in enumerate(calls):
            arguments = call["function"]["arguments"]
            header = {"index": index, **call, "function": {"name": call["function"]["name"], "arguments": ""}}
            out.append(ToolDelta(tool_calls=[header]))
            out.append(ToolDelta(tool_calls=[{"index": index, "function": {"arguments": arguments}}]))
        return out
