"""The body of Anthropic's Messages API (/v1/messages, /v1/messages/count_tokens) and its translation into a
chat request, so that a message runs on the chat machinery: the chat template, images, tools and the
tool-call and reasoning parsers, the constraint of tool_choice, the thinking budget.

Content blocks: text, image (base64 or url source), tool_use (assistant turns), tool_result (user turns:
each becomes a tool message, in order, before the turn's other blocks), thinking / redacted_thinking of
earlier assistant turns (accepted and not rendered again: chat templates drop earlier thinking).
`cache_control` is accepted where the API takes it (no effect: every prompt prefix is cached here).
`output_config.format` (structured outputs) is a JSON-schema constraint; temperature / top_p / top_k, which
older clients send, are still taken. Server tools, MCP
servers, containers and documents are refused with a 400 naming them; unknown fields are 400."""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import Field, ValidationError, model_validator

from radixgen.common.http_errors import bad_request
from radixgen.runtime.server.protocol import ChatCompletionRequest, _refuse_if_set, _Strict

IMAGE_TYPES = ("image/jpeg", "image/png", "image/gif", "image/webp")
_BLOCK_FIELDS = {  # block type -> the fields it may carry
    "text": {"type", "text", "cache_control", "citations"},
    "image": {"type", "source", "cache_control"},
    "tool_use": {"type", "id", "name", "input", "cache_control"},
    "tool_result": {"type", "tool_use_id", "content", "is_error", "cache_control"},
    "thinking": {"type", "thinking", "signature"},
    "redacted_thinking": {"type", "data"},
}
TOOL_REFUSED = {"allowed_callers": "programmatic tool calling", "defer_loading": "tool search",
                "input_examples": "tool input examples"}
_ROLE_BLOCKS = {"user": ("text", "image", "tool_result"), "assistant": ("text", "tool_use", "thinking",
                                                                        "redacted_thinking")}


class CountTokensRequest(_Strict):
    model: str
    messages: list[dict[str, Any]] = Field(min_length=1)
    system: str | list[dict[str, Any]] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: dict[str, Any] | None = None
    thinking: dict[str, Any] | None = None
    output_config: dict[str, Any] | None = None  # effort -> the template's reasoning_effort; format -> a constraint
    cache_control: dict[str, Any] | None = None  # no effect: every prompt prefix is cached
    mcp_servers: list[dict[str, Any]] | None = None
    diagnostics: dict[str, Any] | None = None

    @model_validator(mode="after")
    def _refused(self):
        _refuse_if_set(self, {"mcp_servers": "MCP servers", "diagnostics": "diagnostics"})
        return self


class MessagesRequest(CountTokensRequest):
    max_tokens: int = Field(ge=1)
    stop_sequences: list[str] | None = None
    stream: bool = False
    temperature: float | None = Field(None, ge=0.0, le=1.0)
    top_p: float | None = Field(None, ge=0.0, le=1.0)
    top_k: int | None = Field(None, ge=0)
    metadata: dict[str, Any] | None = None  # user_id: for the caller's own records, no effect here
    # no effect here: one tier, one speed, one place; ids for the caller's own records
    service_tier: Literal["auto", "standard_only"] | None = None
    speed: Literal["standard", "fast"] | None = None
    inference_geo: str | None = None
    user_profile_id: str | None = None
    workspace_id: str | None = None
    container: str | None = None
    context_management: dict[str, Any] | None = None

    @model_validator(mode="after")
    def _refused_here(self):
        _refuse_if_set(self, {"container": "code-execution containers", "context_management": "context management"})
        return self


def _blocks(content: Any, where: str, kinds: tuple[str, ...]) -> list[dict[str, Any]]:
    """`content` as a list of checked blocks (a string is one text block)."""
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    if not isinstance(content, list):
        raise bad_request(f"{where}: a string or a list of content blocks", "messages")
    for j, b in enumerate(content):
        kind = b.get("type") if isinstance(b, dict) else None
        if kind not in kinds:
            raise bad_request(f"{where}[{j}].type: one of {', '.join(kinds)} here; got {kind!r}", "messages")
        unknown = sorted(set(b) - _BLOCK_FIELDS[kind])
        if unknown:
            raise bad_request(f"{where}[{j}]: unknown fields {unknown} for a {kind} block", "messages")
    return content


def _string(block: dict, name: str, where: str) -> str:
    value = block.get(name)
    if not isinstance(value, str):
        raise bad_request(f"{where}.{name}: required (a string), got {value!r}", "messages")
    return value


def _image_part(block: dict, where: str) -> dict[str, Any]:
    src = block.get("source")
    kind = src.get("type") if isinstance(src, dict) else None
    if kind == "base64":
        media = src.get("media_type")
        if media not in IMAGE_TYPES:
            raise bad_request(f"{where}.source.media_type: one of {', '.join(IMAGE_TYPES)}; got {media!r}",
                              "messages")
        url = f"data:{media};base64,{_string(src, 'data', where + '.source')}"
    elif kind == "url":
        url = _string(src, "url", where + ".source")
    else:
        raise bad_request(f"{where}.source.type: base64 or url; got {kind!r}", "messages")
    return {"type": "image_url", "image_url": {"url": url}}


def _tool_result(block: dict, where: str) -> dict[str, Any]:
    content = block.get("content", "")
    if isinstance(content, list):
        content = "".join(_string(b, "text", f"{where}.content[{k}]")
                          for k, b in enumerate(_blocks(content, f"{where}.content", ("text",))))
    elif not isinstance(content, str):
        raise bad_request(f"{where}.content: a string or a list of text blocks", "messages")
    if block.get("is_error"):
        content = "Error: " + content
    return {"role": "tool", "tool_call_id": _string(block, "tool_use_id", where), "content": content}


def chat_messages(req: CountTokensRequest) -> list[dict[str, Any]]:
    """The conversation as OpenAI chat messages (system first)."""
    msgs: list[dict[str, Any]] = []
    if req.system is not None:
        parts = _blocks(req.system, "system", ("text",))
        msgs.append({"role": "system", "content": "".join(_string(b, "text", "system") for b in parts)})
    for i, m in enumerate(req.messages):
        where = f"messages[{i}]"
        role = m.get("role") if isinstance(m, dict) else None
        if role not in _ROLE_BLOCKS:
            raise bad_request(f"{where}.role: user or assistant; got {role!r}", "messages")
        if set(m) - {"role", "content"}:
            raise bad_request(f"{where}: unknown fields {sorted(set(m) - {'role', 'content'})}", "messages")
        blocks = _blocks(m.get("content"), f"{where}.content", _ROLE_BLOCKS[role])
        parts: list[dict[str, Any]] = []
        calls: list[dict[str, Any]] = []
        for j, b in enumerate(blocks):
            at = f"{where}.content[{j}]"
            kind = b["type"]
            if kind == "text":
                parts.append({"type": "text", "text": _string(b, "text", at)})
            elif kind == "image":
                parts.append(_image_part(b, at))
            elif kind == "tool_result":
                msgs.append(_tool_result(b, at))
            elif kind == "tool_use":
                if not isinstance(b.get("input"), dict):
                    raise bad_request(f"{at}.input: required (an object)", "messages")
                calls.append({"id": _string(b, "id", at), "type": "function",
                              "function": {"name": _string(b, "name", at), "arguments": json.dumps(b["input"])}})
            # thinking / redacted_thinking of an earlier turn: not rendered again
        if role == "assistant":
            text = "".join(p["text"] for p in parts)
            msgs.append({"role": "assistant", "content": text if text or not calls else None,
                         **({"tool_calls": calls} if calls else {})})
        elif parts:
            only_text = all(p["type"] == "text" for p in parts)
            msgs.append({"role": "user", "content": "".join(p["text"] for p in parts) if only_text else parts})
    return msgs


def _tools(tools: list[dict[str, Any]]) -> list[dict[str, Any]]:
    out = []
    for i, t in enumerate(tools):
        kind = t.get("type", "custom") if isinstance(t, dict) else None
        if kind != "custom":
            raise bad_request(f"tools[{i}].type: only custom (client) tools are supported, got {kind!r}", "tools")
        unknown = sorted(set(t) - {"type", "name", "description", "input_schema", "cache_control", "strict",
                                   "eager_input_streaming", *TOOL_REFUSED})
        if unknown:
            raise bad_request(f"tools[{i}]: unknown fields {unknown}", "tools")
        for name, feature in TOOL_REFUSED.items():
            if t.get(name):
                raise bad_request(f"tools[{i}].{name}: {feature} is not supported by this server", "tools")
        if not isinstance(t.get("input_schema"), dict):
            raise bad_request(f"tools[{i}].input_schema: required (a JSON schema object)", "tools")
        fn = {"name": t.get("name"), "description": t.get("description"), "parameters": t["input_schema"],
              "strict": t.get("strict")}
        out.append({"type": "function", "function": {k: v for k, v in fn.items() if v is not None}})
    return out


def _tool_choice(choice: dict[str, Any] | None) -> dict[str, Any]:
    """tool_choice and parallel_tool_calls of the chat request."""
    if choice is None:
        return {}
    kind = choice.get("type")
    allowed = {"auto": {"type", "disable_parallel_tool_use"}, "any": {"type", "disable_parallel_tool_use"},
               "tool": {"type", "name", "disable_parallel_tool_use"}, "none": {"type"}}
    if kind not in allowed:
        raise bad_request(f"tool_choice.type: one of auto, any, tool, none; got {kind!r}", "tool_choice")
    if set(choice) - allowed[kind]:
        raise bad_request(f"tool_choice: unknown fields {sorted(set(choice) - allowed[kind])}", "tool_choice")
    out: dict[str, Any] = {"tool_choice": {"auto": "auto", "any": "required", "none": "none"}.get(kind)}
    if kind == "tool":
        out["tool_choice"] = {"type": "function", "function": {"name": _string(choice, "name", "tool_choice")}}
    if choice.get("disable_parallel_tool_use"):
        out["parallel_tool_calls"] = False
    return out


def _thinking(thinking: dict[str, Any] | None, max_tokens: int | None) -> dict[str, Any]:
    """adaptive: the model decides (as without `thinking`); enabled: the think block is closed after
    budget_tokens (a model with a reasoning format); disabled: the chat template is asked not to think
    (enable_thinking false, as Qwen3's templates take it). The thinking is shown (display summarized)."""
    if thinking is None:
        return {}
    kind = thinking.get("type")
    if thinking.get("display", "summarized") not in ("summarized", None):
        raise bad_request(f"thinking.display: only 'summarized' (the thinking as written) is supported, got "
                          f"{thinking['display']!r}", "thinking")
    fields = set(thinking) - {"display"}
    if kind == "disabled" and fields == {"type"}:
        return {"chat_template_kwargs": {"enable_thinking": False}}
    if kind == "adaptive" and fields == {"type"}:
        return {}
    if kind != "enabled" or fields - {"type", "budget_tokens"}:
        raise bad_request(f"thinking: {{'type': 'enabled', 'budget_tokens': N}}, {{'type': 'adaptive'}} or "
                          f"{{'type': 'disabled'}}; got {thinking!r}", "thinking")
    budget = thinking.get("budget_tokens")
    if not isinstance(budget, int) or isinstance(budget, bool) or budget < 1:
        raise bad_request(f"thinking.budget_tokens: a positive integer, got {budget!r}", "thinking")
    if max_tokens is not None and budget >= max_tokens:
        raise bad_request(f"thinking.budget_tokens ({budget}) must be less than max_tokens ({max_tokens})",
                          "thinking")
    return {"max_thinking_tokens": budget}


def _output_config(config: dict[str, Any] | None) -> dict[str, Any]:
    """effort -> reasoning_effort for the chat template; format (a JSON schema) -> response_format."""
    if not config:
        return {}
    unknown = sorted(set(config) - {"effort", "format"})
    if unknown:
        raise bad_request(f"output_config: unknown fields {unknown}", "output_config")
    out: dict[str, Any] = {}
    effort = config.get("effort")
    if effort is not None:
        if effort not in ("low", "medium", "high", "xhigh", "max"):
            raise bad_request(f"output_config.effort: one of low, medium, high, xhigh, max; got {effort!r}",
                              "output_config")
        out["reasoning_effort"] = effort if effort in ("low", "medium", "high") else "high"
    fmt = config.get("format")
    if fmt is not None:
        if not isinstance(fmt, dict) or fmt.get("type") != "json_schema" or not isinstance(fmt.get("schema"), dict) \
                or set(fmt) - {"type", "schema"}:
            raise bad_request("output_config.format: {'type': 'json_schema', 'schema': {...}}", "output_config")
        out["response_format"] = {"type": "json_schema", "json_schema": {"name": "output", "schema": fmt["schema"]}}
    return out


def to_chat(req: CountTokensRequest) -> ChatCompletionRequest:
    """The chat request a message runs as (count_tokens renders the same prompt)."""
    full = req if isinstance(req, MessagesRequest) else None
    body: dict[str, Any] = {
        "model": req.model, "messages": chat_messages(req), "tools": _tools(req.tools or []) or None,
        **_tool_choice(req.tool_choice), **_thinking(req.thinking, full.max_tokens if full else None),
        **_output_config(req.output_config),
    }
    if full is not None:
        body.update(stream=full.stream, max_tokens=full.max_tokens, stop=full.stop_sequences,
                    temperature=full.temperature, top_p=full.top_p, top_k=full.top_k)
    if not any(m["role"] in ("user", "tool") for m in body["messages"]):
        raise bad_request("messages: no user turn to answer", "messages")
    if body["messages"][-1]["role"] == "assistant":  # a prefilled answer: the model continues it
        body["continue_final_message"] = True
    try:
        return ChatCompletionRequest.model_validate_json(json.dumps({k: v for k, v in body.items() if v is not None}))
    except ValidationError as e:
        err = e.errors()[0]
        msg = str(err["msg"]).removeprefix("Value error, ")
        loc = ".".join(str(x) for x in err["loc"])
        raise bad_request(f"{loc}: {msg}" if loc else msg, str(err["loc"][0]) if err["loc"] else None) from None
