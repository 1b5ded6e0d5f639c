"""The request of /v1/responses (the OpenAI Responses API) and its translation into a chat request, so that
a response runs on the chat machinery: the chat template, tool-call and reasoning parsers, strict tools,
``text.format`` as response_format, the thinking budget.

Input items: messages (``input_text`` / ``output_text`` parts), ``function_call`` and ``function_call_output``
items of an earlier turn, and ``reasoning`` items, accepted and not rendered again (chat templates drop
the thinking of earlier turns). Tools are the flattened function tools (``{"type": "function", "name",
"parameters", "strict"}``; strict unless ``strict`` is false, as OpenAI's default). Anything else is a
400 naming where it stands."""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import Field, ValidationError, model_validator

from radixgen.common.http_errors import bad_request
from radixgen.runtime.server.declared_fields import declared_check
from radixgen.runtime.server.protocol import INT64_MAX, ChatCompletionRequest, _refuse_if_set, _Strict

ITEM_TYPES = ("message", "function_call", "function_call_output", "reasoning")


class ResponsesRequest(_Strict):
    model: str | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: Literal["none", "auto", "required"] | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    text: dict[str, Any] | None = None
    reasoning: dict[str, Any] | None = None
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    stream: bool = False
    stream_options: dict[str, Any] | None = None
    store: bool = True  # kept in memory (bounded) so that previous_response_id can continue it
    previous_response_id: str | None = None
    truncation: Literal["disabled"] | None = None  # "auto" (dropping old input) is not supported
    # no effect here (as on /v1/chat/completions)
    metadata: dict[str, str] | None = None
    user: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    service_tier: Literal["auto", "default", "flex", "scale", "priority"] | None = None
    # refused when set
    background: bool | None = None
    conversation: str | dict[str, Any] | None = None
    prompt: dict[str, Any] | None = None
    include: list[str] | None = None
    max_tool_calls: int | None = None
    top_logprobs: int | None = None
    context_management: list[dict[str, Any]] | None = None
    # extra body (SGLang-style): reproducible sampling, the thinking budget
    seed: int | None = Field(None, ge=-INT64_MAX - 1, le=INT64_MAX)
    max_thinking_tokens: int | None = None  # its range: the declaration's

    _thinking_budget = declared_check("max_thinking_tokens")

    @model_validator(mode="after")
    def _refused(self) -> ResponsesRequest:
        _refuse_if_set(self, {"background": "background responses", "conversation": "conversations",
                              "prompt": "stored prompts", "include": "extra output (include)",
                              "max_tool_calls": "a limit on built-in tool calls", "top_logprobs": "logprobs",
                              "context_management": "context management"})
        if isinstance(self.input, list) and not self.input and self.previous_response_id is None:
            raise ValueError("input must not be empty")
        return self


def _text_of(content: Any, where: str, kinds: tuple[str, ...]) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad_request(f"{where}: a string or a list of content parts", "input")
    parts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in kinds or not isinstance(part.get("text"), str):
            raise bad_request(f"{where}[{j}]: only text parts ({', '.join(kinds)}) are supported, got type "
                              f"{kind!r}", "input")
        parts.append(part["text"])
    return "".join(parts)


def _field(item: dict, name: str, where: str) -> str:
    value = item.get(name)
    if not isinstance(value, str):
        raise bad_request(f"{where}.{name}: required (a string), got {value!r}", "input")
    return value


def input_messages(items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Chat messages of Responses input items (consecutive function calls form one assistant turn)."""
    msgs: list[dict[str, Any]] = []
    for i, item in enumerate(items):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise bad_request(f"{where}: an input item is an object, got {type(item).__name__}", "input")
        kind = item.get("type", "message" if "role" in item else None)
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "system", "developer", "assistant"):
                raise bad_request(f"{where}.role: one of user, system, developer, assistant; got {role!r}", "input")
            kinds = ("output_text", "refusal") if role == "assistant" else ("input_text",)
            msgs.append({"role": role, "content": _text_of(item.get("content"), f"{where}.content", kinds)})
        elif kind == "function_call":
            call = {"id": _field(item, "call_id", where), "type": "function",
                    "function": {"name": _field(item, "name", where), "arguments": _field(item, "arguments", where)}}
            if msgs and msgs[-1]["role"] == "assistant":  # the calls of one turn (after its text, if any)
                msgs[-1].setdefault("tool_calls", []).append(call)
            else:
                msgs.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            output = item.get("output")
            msgs.append({"role": "tool", "tool_call_id": _field(item, "call_id", where),
                         "content": _text_of(output, f"{where}.output", ("input_text", "output_text"))
                         if output is not None else _field(item, "output", where)})
        elif kind == "reasoning":
            continue  # thinking of an earlier turn: the template does not render it again
        else:
            raise bad_request(f"{where}.type: unknown input item type {kind!r} (supported: "
                              f"{', '.join(ITEM_TYPES)})", "input")
    return msgs


def _tools(tools: list[dict[str, Any]]) -> list[dict[str, Any]]:
    out = []
    for i, t in enumerate(tools):
        if not isinstance(t, dict) or t.get("type") != "function":
            kind = t.get("type") if isinstance(t, dict) else t
            raise bad_request(f"tools[{i}].type: only function tools are supported, got {kind!r}", "tools")
        unknown = sorted(set(t) - {"type", "name", "description", "parameters", "strict"})
        if unknown:
            raise bad_request(f"tools[{i}]: unsupported fields {unknown}", "tools")
        fn = {k: t[k] for k in ("name", "description", "parameters") if t.get(k) is not None}
        fn["strict"] = t.get("strict") is not False  # the Responses API's default: strict
        out.append({"type": "function", "function": fn})
    return out


def _tool_choice(choice: Any) -> Any:
    if choice is None or isinstance(choice, str):
        return choice
    if choice.get("type") != "function" or not isinstance(choice.get("name"), str) or set(choice) - {"type", "name"}:
        raise bad_request(f"tool_choice: 'none', 'auto', 'required' or {{'type': 'function', 'name': ...}}; got "
                          f"{choice!r}", "tool_choice")
    return {"type": "function", "function": {"name": choice["name"]}}


def _response_format(text: dict[str, Any] | None) -> dict[str, Any] | None:
    if text is None:
        return None
    unknown = sorted(set(text) - {"format", "verbosity"})
    if unknown:
        raise bad_request(f"text: unsupported fields {unknown}", "text")
    fmt = text.get("format")
    if fmt is None:
        return None
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind in ("text", "json_object"):
        if set(fmt) != {"type"}:
            raise bad_request(f"text.format: type {kind!r} takes no other fields", "text")
        return {"type": kind}
    if kind != "json_schema":
        raise bad_request(f"text.format.type: one of text, json_object, json_schema; got {kind!r}", "text")
    if not isinstance(fmt.get("schema"), dict):
        raise bad_request("text.format.schema: required (a JSON schema object) for type json_schema", "text")
    unknown = sorted(set(fmt) - {"type", "name", "schema", "strict", "description"})
    if unknown:
        raise bad_request(f"text.format: unsupported fields {unknown}", "text")
    return {"type": "json_schema", "json_schema": {k: fmt[k] for k in ("name", "schema", "strict", "description")
                                                   if k in fmt}}


def _reasoning(reasoning: dict[str, Any] | None) -> dict[str, Any]:
    """`effort` goes to the chat template (``reasoning_effort``); "none" switches a Qwen3's thinking off.
    `summary` is accepted, and no summary is written: the reasoning item carries the whole thinking text."""
    if not reasoning:
        return {}
    unknown = sorted(set(reasoning) - {"effort", "summary", "generate_summary"})
    if unknown:
        raise bad_request(f"reasoning: unsupported fields {unknown}", "reasoning")
    effort = reasoning.get("effort")
    if effort is None:
        return {}
    if effort not in ("none", "minimal", "low", "medium", "high", "xhigh"):
        raise bad_request(f"reasoning.effort: one of none, minimal, low, medium, high, xhigh; got {effort!r}",
                          "reasoning")
    out: dict[str, Any] = {"reasoning_effort": "high" if effort == "xhigh" else effort}
    if effort == "none":
        out["chat_template_kwargs"] = {"enable_thinking": False}
    return out


def to_chat(req: ResponsesRequest, history: list[dict[str, Any]]) -> ChatCompletionRequest:
    """The chat request a response runs as; `history`: the input items (and outputs) of the previous response."""
    items = history + ([{"role": "user", "content": req.input}] if isinstance(req.input, str) else req.input)
    messages = input_messages(items)
    if req.instructions is not None:
        messages.insert(0, {"role": "system", "content": req.instructions})
    if not messages:
        raise bad_request("input: no messages to respond to", "input")
    body: dict[str, Any] = {
        "model": req.model, "messages": messages, "stream": req.stream, "max_completion_tokens": req.max_output_tokens,
        "temperature": req.temperature, "top_p": req.top_p, "seed": req.seed, "tools": _tools(req.tools or []) or None,
        "tool_choice": _tool_choice(req.tool_choice), "response_format": _response_format(req.text),
        "max_thinking_tokens": req.max_thinking_tokens, **_reasoning(req.reasoning),
    }
    if req.parallel_tool_calls is not None:
        body["parallel_tool_calls"] = req.parallel_tool_calls
    try:
        return ChatCompletionRequest.model_validate_json(json.dumps({k: v for k, v in body.items() if v is not None}))
    except ValidationError as e:
        err = e.errors()[0]  # named as the chat request names it (the fields mostly share their names)
        msg = str(err["msg"]).removeprefix("Value error, ")
        loc = ".".join(str(x) for x in err["loc"])
        raise bad_request(f"{loc}: {msg}" if loc else msg, str(err["loc"][0]) if err["loc"] else None) from None
