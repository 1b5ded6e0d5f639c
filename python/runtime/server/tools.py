"""Function calling: tools into the prompt, tool_choice into a JSON-schema constraint, output into tool_calls.

Output formats, by tool_choice:
- "auto": free text; calls are written in the model's own format (``--tool-call-parser``, else detected
  from the chat template: see server/parsers), read out of the text as it streams.
- "required": constrained to a JSON array of ``{"name", "arguments"}`` objects, one schema branch per
  tool (a single object when parallel_tool_calls is false). A tool's parameters that hold local $refs
  ("#/$defs/node", "#") are moved under the wrapper's own $defs, their refs rebased onto it, so that every
  schema the constraint compiler takes works under "required" as under "auto".
- a named function: constrained to that function's arguments object.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from radixgen.common.nesting import check_value_depth
from radixgen.common.parsers import ForcedParser, NamedParser, ToolParser
from radixgen.runtime.server.protocol import NamedToolChoice, Tool

_ANY_OBJECT = {"type": "object"}


def parameters_schema(tool: Tool) -> dict[str, Any]:
    return tool.function.parameters or _ANY_OBJECT


_VALUES = frozenset({"const", "enum", "default", "examples"})  # keywords whose values are data, not schemas
_MAPS = frozenset({"properties", "$defs", "definitions", "patternProperties", "dependentSchemas"})  # name -> schema


def _has_local_ref(node: Any, names: bool = False) -> bool:
    """Whether a schema (`names`: a map of names to schemas) holds a local $ref anywhere."""
    if isinstance(node, dict):
        if names:
            return any(_has_local_ref(v) for v in node.values())
        ref = node.get("$ref")
        return (isinstance(ref, str) and ref.startswith("#")) or any(
            _has_local_ref(v, k in _MAPS) for k, v in node.items() if k not in _VALUES)
    return isinstance(node, list) and any(_has_local_ref(v) for v in node)


def _rebased(node: Any, base: str, names: bool = False) -> Any:
    """`node` with every local $ref "#<pointer>" made "<base><pointer>" (the schema moved under `base`)."""
    if isinstance(node, dict):
        if names:
            return {k: _rebased(v, base) for k, v in node.items()}
        return {k: (base + v[1:] if k == "$ref" and isinstance(v, str) and v.startswith("#")
                    else v if k in _VALUES else _rebased(v, base, k in _MAPS)) for k, v in node.items()}
    return [_rebased(v, base) for v in node] if isinstance(node, list) else node


def _arguments(tools: list[Tool]) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Each tool's arguments schema inside the wrapper, and the wrapper's $defs (the parameters that refer
    to themselves, rebased: their pointers were relative to their own root)."""
    args, defs = [], {}
    for i, t in enumerate(tools):
        params = parameters_schema(t)
        check_value_depth(params, f"tools[{i}].function.parameters")
        if _has_local_ref(params):
            defs[f"tool{i}"] = _rebased(params, f"#/$defs/tool{i}")
            params = {"$ref": f"#/$defs/tool{i}"}
        args.append(params)
    return args, defs


def _call_schema(tool: Tool, arguments: dict[str, Any]) -> dict[str, Any]:
    return {
        "type": "object",
        "properties": {"name": {"const": tool.function.name}, "arguments": arguments},
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
    args, defs = _arguments(tools)
    calls = [_call_schema(t, a) for t, a in zip(tools, args, strict=True)]
    one = calls[0] if len(calls) == 1 else {"anyOf": calls}
    schema = one if not parallel else {"type": "array", "items": one, "minItems": 1}
    return {**schema, "$defs": defs} if defs else schema


def tool_parser(
    tools: list[Tool], choice: str | NamedToolChoice, fmt: type[ToolParser], forced_in_format: bool = False
) -> Callable[[], ToolParser] | None:
    """A maker of one choice's tool-call parser for `choice` (None: tool_choice none, calls are not read).
    auto: the model's own format `fmt`; required / named: the JSON the grammar lets out, or `fmt` where the
    grammar forces the call in that format (`forced_in_format`: harmony)."""
    schemas = {t.function.name: parameters_schema(t) for t in tools}
    if choice == "none":
        return None
    if choice == "auto" or forced_in_format:
        return lambda: fmt(schemas)
    if isinstance(choice, NamedToolChoice):
        return lambda: NamedParser(schemas, choice.function.name)
    return lambda: ForcedParser(schemas)
