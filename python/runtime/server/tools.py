"""Function calling: tools into the prompt, tool_choice into a JSON-schema constraint, output into tool_calls.

Output formats, by tool_choice:
- "auto": free text; calls are written in the model's own format (``--tool-call-parser``, else detected
  from the chat template: see server/parsers), read out of the text as it streams.
- "required": constrained to a JSON array of ``{"name", "arguments"}`` objects, one schema branch per
  tool (a single object when parallel_tool_calls is false).
- a named function: constrained to that function's arguments object.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from radixgen.common.parsers import ForcedParser, NamedParser, ToolParser
from radixgen.runtime.server.protocol import NamedToolChoice, Tool

_ANY_OBJECT = {"type": "object"}


def parameters_schema(tool: Tool) -> dict[str, Any]:
    return tool.function.parameters or _ANY_OBJECT


def _call_schema(tool: Tool) -> dict[str, Any]:
    return {
        "type": "object",
        "properties": {"name": {"const": tool.function.name}, "arguments": parameters_schema(tool)},
        "required": ["name", "arguments"],
        "additionalProperties": False,
    }


def tool_choice_schema(
    tools: list[Tool], choice: str | NamedToolChoice, parallel: bool = True
) -> dict[str, Any] | None:
    """The JSON schema enforcing `choice`, or None when the output is unconstrained (auto / none)."""
    if isinstance(choice, NamedToolChoice):
        tool = next(t for t in tools if t.function.name == choice.function.name)
        return parameters_schema(tool)
    if choice != "required":
        return None
    one = _call_schema(tools[0]) if len(tools) == 1 else {"anyOf": [_call_schema(t) for t in tools]}
    if not parallel:
        return one
    return {"type": "array", "items": one, "minItems": 1}


def tool_parser(
    tools: list[Tool], choice: str | NamedToolChoice, fmt: type[ToolParser]
) -> Callable[[], ToolParser] | None:
    """A maker of one choice's tool-call parser for `choice` (None: tool_choice none, calls are not read).
    auto: the model's own format `fmt`; required / named: the JSON the grammar lets out."""
    schemas = {t.function.name: parameters_schema(t) for t in tools}
    if choice == "none":
        return None
    if choice == "auto":
        return lambda: fmt(schemas)
    if isinstance(choice, NamedToolChoice):
        return lambda: NamedParser(schemas, choice.function.name)
    return lambda: ForcedParser(schemas)
