"""Agents in the language: `gen(..., tools=[...])` reads the model's tool calls out of its output into a
variable, `gen(..., reasoning=True)` keeps a reasoning model's think block out of the answer variable.

The text of the state keeps the whole output (thinking and calls included), so the next turn's prompt
extends this one's and the radix cache serves it. The parsers are the server's (pure text code, shared
rather than written twice); with tool_choice "required" (or a named tool) a grammar in the tool-call
format makes the model call, with valid arguments."""

from __future__ import annotations

import inspect
import json
import typing
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

_JSON_TYPES = {str: "string", int: "integer", float: "number", bool: "boolean", list: "array", dict: "object"}


class ToolCall(NamedTuple):
    """One call the model made: its id, the function's name, and the arguments (parsed JSON, or the raw
    text when they do not parse, e.g. cut off by max_tokens)."""

    id: str
    name: str
    arguments: Any


class AgentOutput(NamedTuple):
    content: str | None
    reasoning: str | None
    calls: list[ToolCall]


def function_spec(tool: dict | Callable) -> dict[str, Any]:
    """An OpenAI function dict ({"name", "description", "parameters"}) for a tool given as such a dict, an
    OpenAI tool dict ({"type": "function", "function": {...}}), or a Python function (its name, docstring
    and annotated parameters: str / int / float / bool / list / dict)."""
    if isinstance(tool, dict):
        spec = tool.get("function", tool) if tool.get("type") == "function" else tool
        if not isinstance(spec.get("name"), str):
            raise ValueError(f"gen.tools: a tool needs a name, got {tool!r}")
        return spec
    if not callable(tool):
        raise ValueError(f"gen.tools: a tool is a dict or a function, got {tool!r}")
    props, required = {}, []
    hints = typing.get_type_hints(tool)  # annotations may be strings (from __future__ import annotations)
    for p in inspect.signature(tool).parameters.values():
        if hints.get(p.name) not in _JSON_TYPES:
            raise ValueError(f"gen.tools: parameter {p.name!r} of {tool.__name__} needs a str, int, float, bool, "
                             "list or dict annotation")
        props[p.name] = {"type": _JSON_TYPES[hints[p.name]]}
        if p.default is inspect.Parameter.empty:
            required.append(p.name)
    return {"name": tool.__name__, "description": inspect.getdoc(tool) or "",
            "parameters": {"type": "object", "properties": props, "required": required, "additionalProperties": False}}


def tools_prompt(tools: Sequence[dict | Callable], tool_call_parser: str = "hermes") -> str:
    """The system-prompt text that describes `tools` and how to call them in that format."""
    from radixgen.common.parsers import tool_parser_class

    return tool_parser_class(tool_call_parser).instructions([function_spec(t) for t in tools])


def calls_grammar(specs: Sequence[dict], tool_choice: str, tool_call_parser: str, parallel: bool) -> str | None:
    """EBNF making the output calls only (tool_choice "required" or a tool's name), None for "auto"."""
    if tool_choice == "auto":
        return None
    from radixgen.common.grammar.compose import ebnf_of
    from radixgen.common.grammar.tool_formats import ToolSpec, only_calls
    from radixgen.common.parsers import tool_parser_class

    chosen = [s for s in specs if tool_choice in ("required", s["name"])]
    if not chosen:
        raise ValueError(f"gen.tool_choice: {tool_choice!r} is not 'auto', 'required' or a tool's name")
    tools = [ToolSpec(s["name"], s.get("parameters") or {"type": "object"}, where=f"tool {s['name']!r}")
             for s in chosen]
    return ebnf_of(only_calls(tool_parser_class(tool_call_parser).name, tools, parallel=parallel))


def open_think_block(prompt: str, reasoning_parser: str) -> str:
    """The text that opens the think block after `prompt` ("" when the prompt has opened it)."""
    from radixgen.common.parsers import reasoning_format

    fmt = reasoning_format(reasoning_parser)
    return "" if fmt.thinking_at_start(prompt) or prompt.rstrip().endswith(fmt.end) else fmt.start + "\n"


def thinking_params(params: dict[str, Any], choices: str | None, reasoning_parser: str, prompt: str,
                    budget: int | None) -> dict[str, Any]:
    """Sampling fields of a gen with reasoning: its constraint (regex / json_schema / ebnf in `params`, or
    `choices`) as one grammar that starts after the think block, the way the server composes a chat
    request's (grammar/compose.after_thinking: the same request, the same batched step), and the budget."""
    from radixgen.common.grammar.compose import after_thinking, constraint_grammar, ebnf_of
    from radixgen.common.grammar.schema import ConstraintError
    from radixgen.common.parsers import reasoning_format

    fmt = reasoning_format(reasoning_parser)
    out: dict[str, Any] = {}
    if fmt.name == "harmony" and (budget is not None or choices is not None
                                  or any(params.get(k) is not None for k in ("regex", "json_schema", "ebnf"))):
        raise ValueError("gen: the harmony format (gpt-oss) takes no constraint or thinking budget with reasoning yet")
    if budget is not None:
        out.update(max_thinking_tokens=budget, think_end=fmt.end)
    given = [(k, params.pop(k)) for k in ("regex", "json_schema", "ebnf") if params.get(k) is not None]
    if choices is not None:
        given.append(("choices", choices))
    if not given or prompt.rstrip().endswith(fmt.end):  # nothing to move, or the prompt closed the block
        out.update(given)
        return out
    (kind, text), = given
    try:
        answer = constraint_grammar(kind, text)
    except ConstraintError as e:
        raise ValueError(f"gen.{kind}: {e}") from e
    out["ebnf"] = ebnf_of(after_thinking(answer, fmt.start, fmt.end, opened=fmt.thinking_at_start(prompt)))
    return out


def split_output(text: str, specs: Sequence[dict] | None, tool_call_parser: str,
                 reasoning_parser: str | None, prompt: str = "") -> AgentOutput:
    """The output of a gen as content, thinking and calls; `prompt`: the text before it (which may have
    opened the think block)."""
    from radixgen.common.parsers import collect, reasoning_format, tool_parser_class

    reasoning = None
    if reasoning_parser is not None:
        p = reasoning_format(reasoning_parser).parser(prompt)
        parts = [p.feed(text), p.finish()]
        reasoning = "".join(s.reasoning for s in parts) or None
        text = "".join(s.content for s in parts)
    if not specs:
        return AgentOutput(text or None, reasoning, [])
    parser = tool_parser_class(tool_call_parser)({s["name"]: s.get("parameters") or {} for s in specs})
    parsed = collect(parser.feed(text) + parser.finish())
    calls = [ToolCall(c["id"], c["function"]["name"], _json_or_text(c["function"]["arguments"])) for c in parsed.calls]
    return AgentOutput(parsed.content, reasoning, calls)


def _json_or_text(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return text
