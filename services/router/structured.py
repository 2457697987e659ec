"""Structured-output request fields at the HTTP edge, and their one engine ``Constraint``.

Accepted spellings: OpenAI's ``response_format`` (``json_object``, ``json_schema``),
vLLM's ``structured_outputs`` object (``json``, ``regex``, ``choice``, ``grammar``,
``json_object``) and its older top-level ``guided_json`` / ``guided_regex`` /
``guided_choice`` / ``guided_grammar``. At most one constraint per request.
Cheap checks happen here (a 400 naming the field); the workers compile the
grammar, and a grammar that does not compile also comes back as a 400.
"""

from __future__ import annotations

import json
from typing import Any, Literal

import jsonschema
from pydantic import BaseModel, ConfigDict, Field

from shared.structured.constraint import Constraint


class ConstraintError(ValueError):
    """A constraint field the router refuses (answered as a 400 naming ``param``)."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


def bad_request(message: str, param: str) -> ConstraintError:
    return ConstraintError(message, param)


class _Fields(BaseModel):
    model_config = ConfigDict(extra="ignore", populate_by_name=True)


class JSONSchemaFormat(_Fields):
    name: str = "response"
    description: str | None = None
    json_schema: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Fields):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JSONSchemaFormat | None = None


class StructuredOutputs(_Fields):
    # Options not implemented here (structural_tag, whitespace_pattern, ...) are refused, not ignored.
    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    json_spec: dict[str, Any] | str | None = Field(default=None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None


class StructuredOutputFields(_Fields):
    """Mixed into the completion and chat request models."""

    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None

    def output_constraint(self) -> Constraint | None:
        """The request's constraint, or None; raises ConstraintError naming the field that is wrong."""
        found = [(param, c) for param, c in self._candidates() if c is not None]
        if len(found) > 1:
            names = ", ".join(param for param, _ in found)
            raise bad_request(f"send at most one output constraint; got {names}", found[1][0])
        return found[0][1] if found else None

    def _candidates(self) -> list[tuple[str, Constraint | None]]:
        out: list[tuple[str, Constraint | None]] = []
        fmt = self.response_format
        if fmt is not None and fmt.type == "json_object":
            out.append(("response_format", Constraint("json_object")))
        elif fmt is not None and fmt.type == "json_schema":
            if fmt.json_schema is None or fmt.json_schema.json_schema is None:
                raise bad_request(
                    "response_format of type json_schema needs json_schema.schema", "response_format.json_schema"
                )
            out.append(("response_format", json_constraint(fmt.json_schema.json_schema, "response_format")))
        so = self.structured_outputs
        if so is not None:
            out += [
                ("structured_outputs.json", None if so.json_spec is None else json_constraint(so.json_spec, "structured_outputs.json")),
                ("structured_outputs.regex", regex_constraint(so.regex, "structured_outputs.regex")),
                ("structured_outputs.choice", choice_constraint(so.choice, "structured_outputs.choice")),
                ("structured_outputs.grammar", grammar_constraint(so.grammar, "structured_outputs.grammar")),
                ("structured_outputs.json_object", Constraint("json_object") if so.json_object else None),
            ]  # fmt: skip
        out += [
            ("guided_json", None if self.guided_json is None else json_constraint(self.guided_json, "guided_json")),
            ("guided_regex", regex_constraint(self.guided_regex, "guided_regex")),
            ("guided_choice", choice_constraint(self.guided_choice, "guided_choice")),
            ("guided_grammar", grammar_constraint(self.guided_grammar, "guided_grammar")),
        ]
        return out


def json_constraint(schema: dict[str, Any] | str, param: str) -> Constraint:
    """A JSON-schema constraint, after checking the schema against the JSON Schema meta-schema."""
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except json.JSONDecodeError as e:
            raise bad_request(f"{param}: the schema is not valid JSON: {e}", param) from None
    if not isinstance(schema, dict):
        raise bad_request(f"{param}: a JSON schema must be an object, got {type(schema).__name__}", param)
    try:
        jsonschema.validators.validator_for(schema).check_schema(schema)
    except jsonschema.SchemaError as e:
        where = "/".join(str(p) for p in e.path) or "(root)"
        raise bad_request(f"{param}: invalid JSON schema at {where}: {e.message}", param) from None
    return Constraint.json_schema(schema)


def regex_constraint(regex: str | None, param: str) -> Constraint | None:
    if regex is None:
        return None
    if not regex:
        raise bad_request(f"{param} must not be empty", param)
    return Constraint("regex", regex)


def choice_constraint(choices: list[str] | None, param: str) -> Constraint | None:
    if choices is None:
        return None
    if not choices or not all(choices):
        raise bad_request(f"{param} must be a non-empty list of non-empty strings", param)
    return Constraint.choice(choices)


def grammar_constraint(grammar: str | None, param: str) -> Constraint | None:
    if grammar is None:
        return None
    if not grammar.strip():
        raise bad_request(f"{param} must not be empty", param)
    return Constraint("grammar", grammar)
