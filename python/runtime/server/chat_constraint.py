"""The constraint of a chat request, from response_format, tool_choice, strict tools and SGLang's regex /
ebnf / json_schema fields, and how it meets a reasoning model's think block:

- tool_choice "auto" with strict tools: free text, and each call, once its marker is written, has arguments
  valid under its tool's schema (in every tool-call format: grammar/tool_formats.py);
- tool_choice "auto" with a response_format (or another constraint): either valid calls or a valid answer;
- "required" / a named function: the JSON that tools.tool_choice_schema describes; in the harmony format
  (gpt-oss) one call in the format's own messages instead (grammar/tool_formats.harmony_calls);
- a reasoning model whose prompt leaves the think block to the output: any constraint starts after the
  block (the same request, one grammar), and `max_thinking_tokens` closes the block at its budget (the
  block is opened in the prompt when the template leaves opening it to the model).
A strict tool schema with a keyword the grammar cannot enforce is a 400 naming it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, NamedTuple

from radixgen.common.grammar.compose import after_thinking, constraint_grammar, ebnf_of
from radixgen.common.grammar.schema import ConstraintError, analyze_schema, report_unenforced
from radixgen.common.grammar.tool_formats import ToolSpec, auto_calls, calls_or_answer, harmony_calls
from radixgen.common.http_errors import bad_request
from radixgen.runtime.server.protocol import ChatCompletionRequest, NamedToolChoice
from radixgen.runtime.server.tools import parameters_schema, tool_choice_schema

if TYPE_CHECKING:
    from radixgen.runtime.server.openai_chat import ChatServing


class ChatConstraint(NamedTuple):
    prompt: str  # the rendered prompt (with the think block opened when a budget needs it)
    fields: dict[str, Any]  # SamplingParams fields: the constraint, the thinking budget


def _response_schema(req: ChatCompletionRequest) -> dict | None:
    fmt = req.response_format
    if fmt is None or fmt.type == "text":
        return None
    return {"type": "object"} if fmt.type == "json_object" else fmt.json_schema.schema_  # type: ignore[union-attr]


def check_strict_tools(req: ChatCompletionRequest) -> None:
    """400 for a strict tool whose schema has a keyword the grammar cannot enforce (its arguments would
    not always validate)."""
    for i, t in enumerate(req.tools or []):
        if t.function.strict:
            where = f"tools[{i}].function.parameters"
            try:
                report_unenforced(where, analyze_schema(parameters_schema(t)).unenforced, True)
            except ConstraintError as e:
                raise bad_request(f"{e} (the tool is strict)", "tools") from e


def chat_constraint(chat: ChatServing, req: ChatCompletionRequest, prompt: str, with_tools: bool) -> ChatConstraint:
    api, choice = chat.api, req.effective_tool_choice
    cfg = getattr(api.engine, "config", None)
    whitespace = getattr(cfg, "grammar_json_whitespace", "compact")
    strict_json = bool(getattr(cfg, "grammar_strict_json", False))
    tools = (req.tools or []) if with_tools else []
    check_strict_tools(req)
    tool_schema = tool_choice_schema(tools, choice, req.parallel_calls) if tools else None
    if chat.harmony:
        return _harmony_constraint(api, req, prompt, tools, choice, whitespace)
    base = api.constraint(req, response_format=_response_schema(req), tool_choice=tool_schema)
    grammar = None
    try:
        enforce_calls = bool(tools) and choice == "auto" and (bool(base) or any(t.function.strict for t in tools))
        if enforce_calls:
            specs, fmt_name = _tool_specs(req), chat.tool_format.name
            if base:
                answer = constraint_grammar(*next(iter(base.items())), whitespace=whitespace, strict=strict_json)
                grammar = calls_or_answer(fmt_name, answer, specs, parallel=req.parallel_calls, whitespace=whitespace)
            else:
                grammar = auto_calls(fmt_name, specs, whitespace=whitespace)
        fields: dict[str, Any] = {}
        fmt = chat.reasoning
        thinks = fmt is not None and not prompt.rstrip().endswith(fmt.end)  # not closed by the template
        if req.max_thinking_tokens is not None:
            if fmt is None:
                raise bad_request("max_thinking_tokens: the served model has no reasoning format "
                                  "(see --reasoning-parser)", "max_thinking_tokens")
            if thinks:
                if not fmt.thinking_at_start(prompt):
                    prompt = prompt + fmt.start + "\n"  # the budget counts from an open block
                fields.update(max_thinking_tokens=req.max_thinking_tokens, think_end=fmt.end)
        if thinks and (grammar is not None or base):
            if grammar is None:
                grammar = constraint_grammar(*next(iter(base.items())), whitespace=whitespace, strict=strict_json)
            grammar = after_thinking(grammar, fmt.start, fmt.end, opened=fmt.thinking_at_start(prompt))
    except ConstraintError as e:
        raise bad_request(str(e), "tools" if tools else "response_format") from e
    fields.update({"ebnf": ebnf_of(grammar)} if grammar is not None else base)
    return ChatConstraint(prompt, fields)


def _tool_specs(req: ChatCompletionRequest) -> list[ToolSpec]:
    return [ToolSpec(t.function.name, parameters_schema(t), strict=bool(t.function.strict),
                     where=f"tools[{i}].function.parameters") for i, t in enumerate(req.tools or [])]


def _harmony_constraint(api, req: ChatCompletionRequest, prompt: str, tools: list, choice, whitespace: str
                        ) -> ChatConstraint:
    """The harmony format (gpt-oss): tool_choice required / a named function forces one call in the format (its
    thinking first if the model writes it: grammar/tool_formats.harmony_calls); other constraints are refused."""
    forced = bool(tools) and choice not in ("auto", "none")
    others = api.constraint(req, response_format=_response_schema(req))
    if others or req.max_thinking_tokens is not None or (not forced and any(t.function.strict for t in tools)):
        raise bad_request("the harmony format (gpt-oss) takes no constraint but a forced tool call yet: "
                          "response_format, strict tools under tool_choice auto, regex / ebnf / json_schema and "
                          "max_thinking_tokens are refused", "response_format")
    if not forced:
        return ChatConstraint(prompt, {})
    named = choice.function.name if isinstance(choice, NamedToolChoice) else None
    specs = [s for s in _tool_specs(req) if named in (None, s.name)]
    try:
        grammar = harmony_calls(specs, whitespace=whitespace)
    except ConstraintError as e:
        raise bad_request(str(e), "tools") from e
    return ChatConstraint(prompt, {"ebnf": ebnf_of(grammar)})
