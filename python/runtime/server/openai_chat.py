"""/v1/chat/completions: messages through the chat template, response_format, tools (and their legacy
form, functions / function_call, answered in the legacy `function_call` shape), logprobs, streaming."""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator
from contextlib import aclosing
from typing import TYPE_CHECKING, Any, NamedTuple

from starlette.requests import Request
from starlette.responses import Response

from radixgen.common.chat_render import content_text, render_chat
from radixgen.common.harmony_prompt import render_harmony
from radixgen.common.http_errors import JSONResponse, bad_request, error_of
from radixgen.common.media import client_sources
from radixgen.common.parsers import (
    detect_reasoning_format,
    detect_tool_parser,
    reasoning_format,
    tool_parser_class,
)
from radixgen.runtime.server.chat_constraint import chat_constraint
from radixgen.runtime.server.chat_output import ChatOutput
from radixgen.runtime.server.openai_stream import SSE_DONE, EventStream, Job, finish_reason_of, json_logprob, sse
from radixgen.runtime.server.protocol import ChatCompletionRequest, ChatMessage, ToolCall
from radixgen.runtime.server.serving import merge
from radixgen.runtime.server.tools import tool_parser

if TYPE_CHECKING:
    from radixgen.runtime.server.openai_api import OpenAIServing

# Arguments of apply_chat_template that the server sets itself: not for chat_template_kwargs.
RESERVED_TEMPLATE_KWARGS = frozenset(
    {
        "conversation",
        "messages",
        "tools",
        "documents",
        "chat_template",
        "add_generation_prompt",
        "continue_final_message",
        "tokenize",
        "padding",
        "truncation",
        "max_length",
        "return_tensors",
        "return_dict",
        "return_assistant_tokens_mask",
        "tokenizer_kwargs",
    }
)


def _json_or_text(arguments: str) -> Any:
    try:
        return json.loads(arguments)
    except ValueError:
        return arguments


def check_tool_history(messages: list[ChatMessage]) -> None:
    """400 for tool turns the template would render as nonsense: a call's arguments that are not a JSON
    object, a tool result answering no earlier call."""
    ids: set[str | None] = set()
    for i, m in enumerate(messages):
        for j, c in enumerate(m.tool_calls or []):
            try:
                args = json.loads(c.function.arguments)
            except ValueError:
                args = None
            if not isinstance(args, dict):
                raise bad_request(f"messages[{i}].tool_calls[{j}].function.arguments: not a JSON object: "
                                  f"{c.function.arguments[:80]!r}", "messages")
            ids.add(c.id)
        if m.role == "tool" and m.tool_call_id is not None and m.tool_call_id not in ids and None not in ids:
            raise bad_request(f"messages[{i}].tool_call_id: {m.tool_call_id!r} answers no earlier tool call",
                              "messages")


class PreparedChat(NamedTuple):
    jobs: list[Job]
    spec: ChatOutput  # how each choice's text becomes message fields
    rid: str


class ChatServing:
    def __init__(self, api: OpenAIServing, reasoning_parser: str | None = None, tool_call_parser: str | None = None):
        """`reasoning_parser` / `tool_call_parser`: format names (server/parsers); None: detected from the
        chat template; reasoning_parser "none": thinking is not separated."""
        self.api = api
        self.tokenizer = api.tokenizer
        template = self.tokenizer.chat_template or ""
        self.template_renders_tools = "tools" in template  # else tools go into a system message
        if reasoning_parser is None:
            self.reasoning = detect_reasoning_format(template)
        else:
            self.reasoning = None if reasoning_parser == "none" else reasoning_format(reasoning_parser)
        self.tool_format = tool_parser_class(tool_call_parser or detect_tool_parser(template))
        # the harmony format (gpt-oss) keeps its special tokens in the text; rendered by us where the template
        # does not write it
        self.harmony = getattr(self.reasoning, "name", None) == "harmony" or self.tool_format.name == "harmony"
        self.render_harmony = self.harmony and "<|channel|>" not in template
        self.template_renders_tools = self.template_renders_tools or self.render_harmony

    # ------------------------------------------------------------ the prompt

    def template_messages(self, req: ChatCompletionRequest, with_tools: bool, images: list) -> list[dict]:
        """The messages as the chat template takes them; their images' sources appended to `images`, in order."""
        check_tool_history(req.messages)
        msgs = []
        for i, m in enumerate(req.messages):
            content = self.message_text(m, i, images)
            role = {"developer": "system", "function": "tool"}.get(m.role, m.role)
            d: dict[str, Any] = {"role": role, "content": content}
            if m.name is not None:
                d["name"] = m.name
            if m.tool_call_id is not None:
                d["tool_call_id"] = m.tool_call_id
            if self.harmony and m.reasoning_content:  # (the gpt-oss template reads it as `thinking`)
                d["reasoning_content"] = d["thinking"] = m.reasoning_content
            calls = list(m.tool_calls or []) + ([ToolCall(function=m.function_call)] if m.function_call else [])
            if calls:
                if self.template_renders_tools:
                    d["tool_calls"] = [
                        {
                            "id": c.id,
                            "type": "function",
                            "function": {"name": c.function.name, "arguments": _json_or_text(c.function.arguments)},
                        }
                        for c in calls
                    ]
                else:  # the template cannot render calls: write them in the format the model was told
                    text = "".join(self.tool_format.format_call(c.function.name, _json_or_text(c.function.arguments))
                                   for c in calls)
                    d["content"] = content + text
            msgs.append(d)
        if with_tools and not self.template_renders_tools:
            note = self.tool_format.instructions([t.model_dump(exclude_none=True)["function"] for t in req.tools or []])
            if msgs[0]["role"] == "system":
                msgs[0] = {**msgs[0], "content": msgs[0]["content"] + "\n\n" + note}
            else:
                msgs.insert(0, {"role": "system", "content": note})
        return msgs

    def message_text(self, m: ChatMessage, i: int, images: list) -> str:
        """The message's text, its image parts (common.chat_render.content_text) as the model's placeholder, their
        sources appended to `images`."""
        if m.content is None:
            if m.role == "assistant" and (m.tool_calls or m.function_call):
                return ""
            raise bad_request(f"messages[{i}].content: required for role {m.role!r}", "messages")
        try:
            text, found = content_text(m.content, self.api.engine.model_info.get("image_token"),
                                       f"messages[{i}].content")
        except ValueError as e:
            raise bad_request(str(e), "messages") from None
        images += client_sources(found)  # a client's strings: no local file unless allowed
        return text

    def output(self, req: ChatCompletionRequest, prompt: str, tools: Any) -> ChatOutput:
        """How the choices' text becomes message fields; the output begins inside a think block when the
        prompt opened one (a constraint starts after the block: chat_constraint)."""
        fmt = self.reasoning if req.separate_reasoning else None
        reasoning = None
        if fmt is not None:
            reasoning = lambda: fmt.parser(prompt)  # noqa: E731
        return ChatOutput(reasoning, tools, req.legacy_functions, req.stream_reasoning)

    def render(self, req: ChatCompletionRequest, with_tools: bool) -> tuple[str, list]:
        """The prompt text through the chat template, and the images whose placeholders it holds."""
        images: list = []
        msgs = self.template_messages(req, with_tools, images)
        kwargs = req.template_kwargs()
        reserved = sorted(RESERVED_TEMPLATE_KWARGS & set(kwargs))
        if reserved:
            raise bad_request(f"chat_template_kwargs: {reserved} are set by the server", "chat_template_kwargs")
        if with_tools and self.template_renders_tools:
            kwargs["tools"] = [t.model_dump(exclude_none=True) for t in req.tools or []]
        cont = req.continue_final_message  # the last (assistant) message is continued, not closed
        if self.render_harmony:
            try:
                return render_harmony(msgs, kwargs.get("tools"), kwargs.get("reasoning_effort"),
                                      add_generation_prompt=not cont), images
            except ValueError as e:
                raise bad_request(f"messages: {e}", "messages") from e
        try:
            return render_chat(self.tokenizer, msgs, continue_final_message=cont, **kwargs), images
        except Exception as e:  # noqa: BLE001 - jinja raises its own kinds for bad message shapes
            raise bad_request(f"messages: the chat template could not be applied: {e}", "messages") from e

    # ------------------------------------------------------------ the request

    async def prepare(self, req: ChatCompletionRequest, rid_prefix: str = "chatcmpl-") -> PreparedChat:
        """The engine jobs of a request and how their text becomes message fields (/v1/responses builds on it)."""
        api = self.api
        lora = api.admit(req)
        choice = req.effective_tool_choice
        with_tools = bool(req.tools) and choice != "none"
        text, images = await self.api.off_loop("messages", self.render, req, with_tools)
        # grammars are built off the event loop (a large schema takes milliseconds)
        built = await self.api.off_loop("tools", chat_constraint, self, req, text, with_tools)
        text, constraint = built.prompt, built.fields
        if images:  # token segments and the processed images (a bad image is a 400 naming it)
            ids, prompt_len = await api.engine.media_prompt(text, images)
        else:
            ids = await self.api.encode(text, add_special_tokens=False)  # the template writes special tokens
            prompt_len = len(ids)
        requested = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        param = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
        sp = api.sampling(req, api.budget(prompt_len, requested, param, "messages"), constraint)
        if self.harmony:  # the parsers read the format's markers, which are special tokens
            sp["skip_special_tokens"] = False
        rid = api.request_id(req, rid_prefix)
        jobs = api.jobs(
            [ids],
            req,
            [sp],
            rid,
            lora=lora,
            return_logprob=req.logprobs,
            top_logprobs_num=req.top_logprobs or 0,
            logprob_start_len=-1,
        )
        tools = tool_parser(req.tools or [], choice if with_tools else "none", self.tool_format, self.harmony)
        return PreparedChat(jobs, self.output(req, text, tools), rid)

    async def create(self, req: ChatCompletionRequest, request: Request) -> Response:
        arrived = time.perf_counter()
        api = self.api
        jobs, spec, rid = await self.prepare(req)
        if req.stream:
            streams = await api.start_stream(jobs, rid, arrived)
            return EventStream(self.stream(req, jobs, streams, spec, rid), lambda: api.dispatcher.end_group(rid))
        outs = await api.run(request, jobs, rid, arrived)
        choices = []
        for job, out in zip(jobs, outs, strict=True):
            meta = out["meta_info"]
            parsed = spec.choice()
            message: dict[str, Any] = {"role": "assistant", **parsed.message(out["text"]), "refusal": None}
            finish = parsed.finish_reason(finish_reason_of(meta))
            lp = {"content": self.logprobs(meta), "refusal": None} if req.logprobs else None
            choices.append({"index": job.index, "message": message, "logprobs": lp, "finish_reason": finish})
        return JSONResponse(
            {
                "id": rid,
                "object": "chat.completion",
                "created": int(time.time()),
                "model": api.response_model(req),
                "choices": choices,
                "usage": api.usage(outs, req.n),
            }
        )

    def logprobs(self, meta: dict, start: int = 0) -> list[dict]:
        token_text = self.api.token_text
        outp = (meta.get("output_token_logprobs") or [])[start:]
        tops = (meta.get("output_top_logprobs") or [None] * (start + len(outp)))[start:]
        entries = []
        for (lp, tid, *_), top in zip(outp, tops, strict=True):
            s = token_text(tid)
            entries.append(
                {
                    "token": s,
                    "logprob": json_logprob(lp),
                    "bytes": list(s.encode()),
                    "top_logprobs": [
                        {"token": token_text(t), "logprob": json_logprob(x), "bytes": list(token_text(t).encode())}
                        for x, t, *_ in top or []
                    ],
                }
            )
        return entries

    async def stream(
        self, req: ChatCompletionRequest, jobs: list[Job], streams: list, spec: ChatOutput, rid: str
    ) -> AsyncIterator[bytes]:
        created = int(time.time())
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        head = {"id": rid, "object": "chat.completion.chunk", "created": created,
                "model": self.api.response_model(req)}

        def chunk(index: int, delta: dict, lp: list | None = None, finish: str | None = None) -> bytes:
            logprobs = None if lp is None else {"content": lp, "refusal": None}
            choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
            return sse({**head, "choices": [choice], **({"usage": None} if include_usage else {})})

        finals: list[dict | None] = [None] * len(jobs)
        sent_lp = [0] * len(jobs)
        parsers = [spec.choice() for _ in jobs]
        try:
            for job in jobs:  # the first delta of each choice carries the role
                yield chunk(job.index, {"role": "assistant", "content": ""})
            async with aclosing(merge(streams)) as events:
                async for i, out in events:
                    job, meta = jobs[i], out["meta_info"]
                    lp = None
                    if req.logprobs:
                        lp = self.logprobs(meta, sent_lp[i])
                        sent_lp[i] += len(lp)
                    deltas = parsers[i].feed(out.get("delta", ""))
                    if lp and not deltas:
                        deltas = [{}]
                    for k, delta in enumerate(deltas):  # the logprobs ride on the first
                        yield chunk(job.index, delta, lp if k == 0 else None)
                    if meta.get("finish_reason") is None:
                        continue
                    finals[i] = out
                    for delta in parsers[i].finish():
                        yield chunk(job.index, delta)
                    finish = parsers[i].finish_reason(finish_reason_of(meta))
                    yield chunk(job.index, {}, None, finish)
            if include_usage:
                yield sse({**head, "choices": [], "usage": self.api.usage(finals, req.n)})  # type: ignore[arg-type]
        except Exception as e:  # noqa: BLE001 - the status line is sent: report it in the stream
            yield sse(error_of(e).body())
        yield SSE_DONE
