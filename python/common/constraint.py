"""The one output constraint of a request, normalised once: `Constraint(kind, text)`.

The same record is the front process's check input (`runtime.grammar.check_constraint`) and the scheduler's
compiled-grammar cache key (`runtime.grammar.CompileCache.submit`), so a JSON schema given as a dict is
serialised exactly once, here, and every later stage sees the same text. "At most one constraint" is checked
here only (`normalize_constraint`); each front end phrases the error in its own terms by catching
`TooManyConstraints`.
"""

from __future__ import annotations

import json
from typing import Any, NamedTuple

from radixgen.common.nesting import check_value_depth

# The kinds, in the order a request's fields are read.
CONSTRAINT_KINDS = ("regex", "json_schema", "ebnf", "choices")


class Constraint(NamedTuple):
    kind: str  # one of CONSTRAINT_KINDS
    text: str  # regex / schema JSON / EBNF / a JSON list of the choices


class TooManyConstraints(ValueError):
    """More than one constraint was given; `given` names them (in the caller's spelling)."""

    def __init__(self, given: list[str], message: str) -> None:
        super().__init__(message)
        self.given = given


def constraint_text(kind: str, value: Any) -> Any:
    """The canonical text of one constraint value: a dict schema (or a list of choices) serialised once;
    a string is kept as given (its bytes are the cache key)."""
    if kind == "json_schema" and isinstance(value, dict):
        check_value_depth(value, "json_schema")  # before anything walks it (json.dumps recurses)
        return json.dumps(value)
    if kind == "choices" and isinstance(value, (list, tuple)):
        return json.dumps(list(value))
    return value


def normalize_constraint(given: dict[str, Any], kinds: dict[str, str] | None = None) -> Constraint | None:
    """The one constraint among `given` (field name -> value; None values are unset), or None.

    `kinds` maps a caller's field name to its constraint kind when they differ (OpenAI's `response_format`
    and `tool_choice` are JSON schemas); by default the name is the kind. More than one set value is a
    TooManyConstraints naming them in the caller's order."""
    kinds = kinds or {}
    set_names = [name for name, value in given.items() if value is not None]
    if len(set_names) > 1:
        raise TooManyConstraints(set_names, f"at most one of {list(given)} may be set, got {set_names}")
    if not set_names:
        return None
    name = set_names[0]
    kind = kinds.get(name, name)
    if kind not in CONSTRAINT_KINDS:
        raise ValueError(f"constraint kind must be one of {CONSTRAINT_KINDS}, got {kind!r}")
    return Constraint(kind, constraint_text(kind, given[name]))
