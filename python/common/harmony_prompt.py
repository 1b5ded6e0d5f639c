"""A conversation as a harmony prompt (gpt-oss), for a model whose chat template does not write the format itself.

- a system message: the model's identity, knowledge cutoff, the current date, ``Reasoning: <effort>`` and the
  valid channels (and, with function tools, that their calls go to the commentary channel);
- a developer message: the client's system / developer messages under ``# Instructions``, then the tools as a
  TypeScript namespace ``functions`` (``# Tools``);
- the turns: a user message; an assistant's answer in the final channel, its calls in the commentary channel to
  ``functions.NAME`` ending in <|call|>, its thinking in the analysis channel only where the turn is still open
  (the analysis of a turn that ended with an answer is dropped, as the format asks); a tool's result from
  ``functions.NAME`` to the assistant;
- ``<|start|>assistant``: the model writes the next message.
"""

from __future__ import annotations

import json
from typing import Any

IDENTITY = "You are ChatGPT, a large language model trained by OpenAI."
KNOWLEDGE_CUTOFF = "2024-06"
EFFORTS = ("low", "medium", "high")
_EFFORT_OF = {"none": "low", "minimal": "low"}  # OpenAI's efforts below the format's lowest


def _text(content: Any) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    return "".join(p.get("text", "") for p in content if isinstance(p, dict))


def _ts_type(schema: Any, indent: str) -> str:
    """A JSON schema as the TypeScript type the format writes."""
    if not isinstance(schema, dict):
        return "any"
    if "enum" in schema:
        return " | ".join(json.dumps(v, ensure_ascii=False) for v in schema["enum"])
    for key in ("anyOf", "oneOf"):
        if isinstance(schema.get(key), list):
            return " | ".join(_ts_type(s, indent) for s in schema[key])
    kind = schema.get("type")
    if isinstance(kind, list):
        return " | ".join(_ts_type({**schema, "type": k}, indent) for k in kind)
    if kind == "array":
        return f"{_ts_type(schema.get('items'), indent)}[]"
    if kind == "object" and isinstance(schema.get("properties"), dict):
        return "{\n" + _ts_fields(schema, indent + "  ") + indent + "}"
    return {"string": "string", "integer": "number", "number": "number", "boolean": "boolean",
            "null": "null", "object": "object"}.get(kind, "any")


def _ts_fields(schema: dict, indent: str) -> str:
    required = set(schema.get("required") or ())
    lines = []
    for name, prop in schema.get("properties", {}).items():
        prop = prop if isinstance(prop, dict) else {}
        if prop.get("description"):
            lines.append(f"{indent}// {prop['description']}\n")
        line = f"{indent}{name}{'' if name in required else '?'}: {_ts_type(prop, indent)},"
        if "default" in prop:
            default = prop["default"]
            line += f" // default: {default if isinstance(default, str) else json.dumps(default, ensure_ascii=False)}"
        lines.append(line + "\n")
    return "".join(lines)


def tools_namespace(functions: list[dict]) -> str:
    """OpenAI function definitions ({"name", "description", "parameters"}) as the format's ``functions``
    namespace (the developer message's ``# Tools`` section)."""
    out = ["# Tools\n\n## functions\n\nnamespace functions {\n\n"]
    for f in functions:
        if f.get("description"):
            out.append(f"// {f['description']}\n")
        params = f.get("parameters") or {}
        if params.get("properties"):
            out.append(f"type {f['name']} = (_: {{\n{_ts_fields(params, '')}}}) => any;\n\n")
        else:
            out.append(f"type {f['name']} = () => any;\n\n")
    out.append("} // namespace functions")
    return "".join(out)


def _functions(tools: list[dict] | None) -> list[dict]:
    return [t.get("function", t) for t in tools or [] if t.get("type", "function") == "function"]


def render_harmony(messages: list[dict[str, Any]], tools: list[dict] | None = None, reasoning_effort: str | None = None,
                   current_date: str | None = None, add_generation_prompt: bool = True) -> str:
    """`messages` (OpenAI chat messages: role, content, tool_calls, tool_call_id, reasoning_content) and `tools`
    (OpenAI tool definitions) as harmony prompt text. ValueError names a bad effort or role."""
    effort = _EFFORT_OF.get(reasoning_effort or "medium", reasoning_effort or "medium")
    if effort not in EFFORTS:
        raise ValueError(f"reasoning_effort: {reasoning_effort!r} is not one of {EFFORTS + tuple(_EFFORT_OF)}")
    functions = _functions(tools)
    system = f"{IDENTITY}\nKnowledge cutoff: {KNOWLEDGE_CUTOFF}\n"
    if current_date:
        system += f"Current date: {current_date}\n"
    system += (f"\nReasoning: {effort}\n\n# Valid channels: analysis, commentary, final. Channel must be included "
               f"for every message.")
    if functions:
        system += "\nCalls to these tools must go to the commentary channel: 'functions'."
    out = [f"<|start|>system<|message|>{system}<|end|>"]
    instructions = [_text(m.get("content")) for m in messages if m.get("role") in ("system", "developer")]
    developer = []
    if any(instructions):
        developer.append("# Instructions\n\n" + "\n\n".join(t for t in instructions if t))
    if functions:
        developer.append(tools_namespace(functions))
    if developer:
        out.append("<|start|>developer<|message|>" + "\n\n".join(developer) + "<|end|>")
    last_user = max((i for i, m in enumerate(messages) if m.get("role") == "user"), default=-1)
    names: dict[str, str] = {}  # tool_call_id -> function name
    for i, m in enumerate(messages):
        role = m.get("role")
        if role in ("system", "developer"):
            continue
        if role == "user":
            out.append(f"<|start|>user<|message|>{_text(m.get('content'))}<|end|>")
        elif role == "assistant":
            out.append(_assistant(m, open_turn=i > last_user and not _answered(messages, i), names=names))
        elif role in ("tool", "function"):
            name = m.get("name") or names.get(m.get("tool_call_id") or "", "")
            if not name:
                raise ValueError(f"messages[{i}]: a tool result answering no earlier call (no name, no "
                                 f"tool_call_id of a call)")
            out.append(f"<|start|>functions.{name} to=assistant<|channel|>commentary<|message|>"
                       f"{_text(m.get('content'))}<|end|>")
        else:
            raise ValueError(f"messages[{i}].role: {role!r} is not system, developer, user, assistant or tool")
    if add_generation_prompt:
        out.append("<|start|>assistant")
    return "".join(out)


def _answered(messages: list[dict], i: int) -> bool:
    """Whether the turn of assistant message i ended with an answer (an assistant message with content and no
    calls at i or after it)."""
    return any(m.get("role") == "assistant" and _text(m.get("content")) and not m.get("tool_calls")
               for m in messages[i:])


def _assistant(m: dict, open_turn: bool, names: dict[str, str]) -> str:
    parts = []
    thinking = m.get("reasoning_content") or m.get("reasoning") or m.get("thinking")
    if thinking and open_turn:  # the chain of thought of a turn still calling tools is kept
        parts.append(f"<|start|>assistant<|channel|>analysis<|message|>{thinking}<|end|>")
    calls = m.get("tool_calls") or []
    content = _text(m.get("content"))
    if content:
        channel = "commentary" if calls else "final"  # text beside calls is a preamble
        parts.append(f"<|start|>assistant<|channel|>{channel}<|message|>{content}<|end|>")
    for c in calls:
        fn = c.get("function", c)
        args = fn.get("arguments", "{}")
        args = args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)
        if c.get("id"):
            names[c["id"]] = fn["name"]
        names[""] = fn["name"]  # a result without an id answers the last call
        parts.append(f"<|start|>assistant<|channel|>commentary to=functions.{fn['name']} <|constrain|>json"
                     f"<|message|>{args}<|call|>")
    return "".join(parts)
