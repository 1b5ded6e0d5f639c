"""Function calling: tools into the prompt, tool_choice into a JSON-schema constraint, output into tool_calls.

Output formats, by tool_choice:
- "auto": free text; a call is written as ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``
  (the format Hermes/Qwen-style chat templates teach), parsed out of the text afterwards.
- "required": constrained to a JSON array of ``{"name", "arguments"}`` objects, one schema branch per
  tool (a single object when parallel_tool_calls is false).
- a named function: constrained to that function's arguments object.
"""

from __future__ import annotations

import json
import re
import uuid
from typing import Any, NamedTuple

from radixgen.runtime.server.protocol import NamedToolChoice, Tool

TOOL_CALL_OPEN = "<tool_call>"
TOOL_CALL_CLOSE = "</tool_call>"
_TOOL_CALL_RE = re.compile(
    re.escape(TOOL_CALL_OPEN) + r"\s*(.*?)\s*(?:" + re.escape(TOOL_CALL_CLOSE) + r"|$)", re.S
)

_ANY_OBJECT = {"type": "object"}


class ParsedCalls(NamedTuple):
    content: str | None  # the text outside the calls (None when empty)
    calls: list[dict[str, Any]]  # OpenAI tool_calls entries


def parameters_schema(tool: Tool) -> dict[str, Any]:
    return tool.function.parameters or _ANY_OBJECT


def tools_system_prompt(tools: list[Tool]) -> str:
    """Describes the tools for chat templates that do not render `tools` themselves."""
    specs = "\n".join(json.dumps(t.model_dump(exclude_none=True)["function"]) for t in tools)
    return (
        "You can call the following functions. To call one, reply with "
        f'{TOOL_CALL_OPEN}{{"name": <function name>, "arguments": <arguments object>}}{TOOL_CALL_CLOSE}'
        " and nothing else.\n\nFunctions:\n" + specs
    )


def format_call(name: str, arguments: Any) -> str:
    """A call written the way the model is told to write one (for assistant turns in the history)."""
    return (
        TOOL_CALL_OPEN
        + json.dumps({"name": name, "arguments": arguments}, ensure_ascii=False)
        + TOOL_CALL_CLOSE
    )


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


def _call(name: str, arguments: Any) -> dict[str, Any]:
    args = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
    return {
        "id": f"call_{uuid.uuid4().hex[:24]}",
        "type": "function",
        "function": {"name": name, "arguments": args},
    }


def parse_constrained(text: str, tools: list[Tool], choice: str | NamedToolChoice, parallel: bool = True):
    """Calls out of the output of a "required" / named constraint; None when it does not parse
    (e.g. the output was cut by max_tokens)."""
    try:
        value = json.loads(text)
    except ValueError:
        return None
    if isinstance(choice, NamedToolChoice):
        return ParsedCalls(None, [_call(choice.function.name, value)])
    items = value if isinstance(value, list) else [value]
    names = {t.function.name for t in tools}
    calls = []
    for item in items:
        if not isinstance(item, dict) or item.get("name") not in names or "arguments" not in item:
            return None
        calls.append(_call(item["name"], item["arguments"]))
    return ParsedCalls(None, calls) if calls else None


def parse_auto(text: str, tools: list[Tool]) -> ParsedCalls:
    """`<tool_call>{...}</tool_call>` blocks naming a known tool become calls; the rest stays content.
    A block that is not valid JSON, or names an unknown tool, stays in the content as text."""
    names = {t.function.name for t in tools}
    calls, kept, pos = [], [], 0
    for m in _TOOL_CALL_RE.finditer(text):
        try:
            obj = json.loads(m.group(1))
        except ValueError:
            continue
        if not isinstance(obj, dict) or obj.get("name") not in names:
            continue
        args = obj.get("arguments", obj.get("parameters", {}))
        calls.append(_call(obj["name"], args))
        kept.append(text[pos : m.start()])
        pos = m.end()
    kept.append(text[pos:])
    content = "".join(kept).strip() if calls else text
    return ParsedCalls(content or None, calls)


class AutoToolStream:
    """Streams content deltas while holding back anything that may be the start of a tool call.

    feed(delta) returns the text safe to send now; once `<tool_call>` appears, everything from it on is
    held until finish(), which parses the held text."""

    def __init__(self, tools: list[Tool]):
        self.tools = tools
        self.pending = ""  # held back: a possible prefix of TOOL_CALL_OPEN, or a call in progress
        self.in_call = False

    def feed(self, delta: str) -> str:
        self.pending += delta
        if self.in_call:
            return ""
        idx = self.pending.find(TOOL_CALL_OPEN)
        if idx >= 0:
            self.in_call = True
            out, self.pending = self.pending[:idx], self.pending[idx:]
        else:
            cut = len(self.pending) - _partial_suffix(self.pending, TOOL_CALL_OPEN)
            out, self.pending = self.pending[:cut], self.pending[cut:]
        return out

    def finish(self) -> ParsedCalls:
        """(the remaining content to send, the calls) at the end of the stream."""
        if not self.in_call:
            rest, self.pending = self.pending, ""
            return ParsedCalls(rest or None, [])
        parsed = parse_auto(self.pending, self.tools)
        if not parsed.calls:
            rest, self.pending = self.pending, ""
            return ParsedCalls(rest, [])
        return parsed


def _partial_suffix(text: str, marker: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `marker`."""
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:k]):
            return k
    return 0


class ChatToolMode:
    """How a chat choice's text becomes content and tool_calls, for its tool_choice."""

    def __init__(self, tools: list[Tool], choice: str | NamedToolChoice, parallel: bool):
        self.tools = tools
        self.choice = choice
        self.parallel = parallel

    def parse(self, text: str) -> ParsedCalls:
        if self.choice == "none":
            return ParsedCalls(text, [])
        if self.choice == "auto":
            return parse_auto(text, self.tools)
        parsed = parse_constrained(text, self.tools, self.choice, self.parallel)
        return parsed if parsed is not None else ParsedCalls(text, [])

    def stream_filter(self) -> ToolStreamFilter:
        return ToolStreamFilter(self)


class ToolStreamFilter:
    """Per-choice streaming of content: everything passes without tools; with tool_choice auto, text
    that may be a call is held back; with a forced call, everything is held and parsed at the end."""

    def __init__(self, mode: ChatToolMode):
        self.mode = mode
        self.auto = AutoToolStream(mode.tools) if mode.choice == "auto" else None
        self.held = mode.choice not in ("none", "auto")

    def feed(self, delta: str) -> str:
        if self.auto is not None:
            return self.auto.feed(delta)
        return "" if self.held else delta

    def finish(self, text: str) -> ParsedCalls:
        """What is left to send at the end: content not yet sent, and the calls."""
        if self.auto is not None:
            return self.auto.finish()
        if self.held:
            return self.mode.parse(text)
        return ParsedCalls(None, [])
