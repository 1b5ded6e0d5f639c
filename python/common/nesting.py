"""Nesting depth of user input, bounded before anything walks it recursively.

A request body, a JSON schema (a dict or its text) and every other nested value a client sends is checked
here against an explicit limit first, so that no walker of it (the JSON parser, the schema analysis, the
grammar compiler, a pydantic model) can reach Python's recursion limit: too deep is a ValueError naming the
limit (a 400), never a RecursionError (which a server would report as its own failure).

Depth counts JSON containers: `{}` and `[]` are 1, `{"a": [1]}` is 2. A schema nests two containers per
level of `properties` (the properties object and the property's schema).
"""

from __future__ import annotations

import re
from array import array
from itertools import accumulate
from typing import Any

MAX_SCHEMA_DEPTH = 64  # containers in one JSON schema (about 32 levels of nested properties)
MAX_BODY_DEPTH = 128  # containers in a request body (a schema at its limit fits in a body with room to spare)

_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"', re.S)
_NOT_BRACKET = re.compile(rb"[^\[\]{}]+")
# "[" "{" -> +1, "]" "}" -> -1 (as signed bytes)
_STEPS = bytes.maketrans(b"[{]}", b"\x01\x01\xff\xff")


class NestingError(ValueError):
    """A value nested deeper than its limit; the message names the limit."""


def text_depth(text: str | bytes) -> int:
    """The deepest nesting of containers in a JSON text (brackets inside strings do not count). Linear
    time and no recursion, whatever the text holds; a malformed text gets a number too (the parser
    says what is wrong with it)."""
    data = text.encode("utf-8", "surrogatepass") if isinstance(text, str) else bytes(text)
    if data.count(b"[") + data.count(b"{") == 0:
        return 0
    brackets = _NOT_BRACKET.sub(b"", _STRING.sub(b"", data))
    return max(0, max(accumulate(array("b", brackets.translate(_STEPS))), default=0))


def value_depth(value: Any, stop_above: int | None = None) -> int:
    """The deepest nesting of dicts and lists (tuples too) in a value, without recursion. With
    `stop_above`, the walk ends as soon as that depth is passed (the result is then stop_above + 1)."""
    deepest = 0
    stack = [(value, 1)]
    while stack:
        node, depth = stack.pop()
        if isinstance(node, dict):
            children = node.values()
        elif isinstance(node, (list, tuple)):
            children = node
        else:
            continue
        deepest = max(deepest, depth)
        if stop_above is not None and depth > stop_above:
            return depth
        stack.extend((c, depth + 1) for c in children if isinstance(c, (dict, list, tuple)))
    return deepest


def check_value_depth(value: Any, what: str, limit: int = MAX_SCHEMA_DEPTH) -> None:
    """A NestingError naming `what` and the limit when `value` nests deeper than `limit` containers."""
    if value_depth(value, stop_above=limit) > limit:
        raise NestingError(f"{what}: nested deeper than the limit of {limit} levels of objects and arrays")


def check_text_depth(text: str | bytes, what: str, limit: int = MAX_SCHEMA_DEPTH) -> None:
    """As check_value_depth, for a JSON text (before it is parsed)."""
    if text_depth(text) > limit:
        raise NestingError(f"{what}: nested deeper than the limit of {limit} levels of objects and arrays")
