"""A request's output constraint, as plain data (torch-free).

A constraint is a kind plus one string: the JSON schema, the regex, the
choices as a JSON list, or the grammar in xgrammar's EBNF. Equal constraints
compile to the same grammar, so the pair is also the grammar cache key.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

CONSTRAINT_KINDS = ("json", "json_object", "regex", "choice", "grammar")


@dataclass(frozen=True)
class Constraint:
    kind: str  # one of CONSTRAINT_KINDS
    spec: str = ""  # JSON schema text, regex, JSON list of choices, or EBNF; "" for json_object

    def __post_init__(self) -> None:
        if self.kind not in CONSTRAINT_KINDS:
            raise ValueError(f"constraint kind must be one of {', '.join(CONSTRAINT_KINDS)}, got {self.kind!r}")

    @classmethod
    def json_schema(cls, schema: object) -> Constraint:
        """A JSON schema given as a dict (serialized canonically, so equal schemas share a cache entry)."""
        text = schema if isinstance(schema, str) else json.dumps(schema, sort_keys=True, separators=(",", ":"))
        return cls("json", text)

    @classmethod
    def choice(cls, choices: list[str]) -> Constraint:
        return cls("choice", json.dumps(list(choices), ensure_ascii=False))

    def choices(self) -> list[str]:
        assert self.kind == "choice"
        return list(json.loads(self.spec))


def choice_ebnf(choices: list[str]) -> str:
    """An EBNF grammar whose language is exactly ``choices`` (JSON string escapes are EBNF escapes)."""
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)
