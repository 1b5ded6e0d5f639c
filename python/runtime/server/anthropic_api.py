"""Anthropic's Messages API: POST /v1/messages (whole or streamed) and /v1/messages/count_tokens, on the chat
path (anthropic_protocol.to_chat, then ChatServing.prepare). A choice's deltas (thinking, text, tool calls)
become content blocks: streamed as Anthropic's events (message_start, ping, content_block_start / delta /
stop per block, message_delta with the stop reason and usage, message_stop), and a whole message is the same
blocks, built by the same code from the same deltas.

Usage: `input_tokens` are the prompt tokens computed for this request, `cache_read_input_tokens` those the
radix cache already held (every prompt is cached as a side effect, so `cache_creation_input_tokens` is 0).
Errors are Anthropic's {"type": "error", "error": {"type", "message"}} (api_errors.py rewrites them)."""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator
from contextlib import aclosing
from typing import TYPE_CHECKING, Any

import orjson
from fastapi import APIRouter, Request
from starlette.responses import Response

from radixgen.common.http_errors import JSONResponse, error_of
from radixgen.runtime.server.anthropic_protocol import CountTokensRequest, MessagesRequest, to_chat
from radixgen.runtime.server.api_errors import ErrorShape
from radixgen.runtime.server.openai_stream import EventStream, finish_reason_of
from radixgen.runtime.server.serving import merge

if TYPE_CHECKING:
    from radixgen.runtime.server.metrics import ServerMetrics
    from radixgen.runtime.server.openai_api import OpenAIServing

ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error", 529: "overloaded_error"}


def anthropic_error(status: int, message: str, code: str | None = None) -> dict[str, Any]:
    kind = ERROR_TYPES.get(status, "api_error" if status >= 500 else "invalid_request_error")
    return {"type": "error", "error": {"type": kind, "message": message}}


ERROR_SHAPE = ErrorShape("/v1/messages", anthropic_error)


def _event(event: dict[str, Any]) -> bytes:
    return b"event: " + event["type"].encode() + b"\ndata: " + orjson.dumps(event) + b"\n\n"


class ContentBlocks:
    """Chat deltas -> content blocks and the stream events that build them. `blocks` is the message's
    content so far (tool_use inputs parsed when their block closes)."""

    def __init__(self) -> None:
        self.blocks: list[dict[str, Any]] = []
        self.open: str | None = None  # the kind of the block being written
        self.args: list[str] = []  # the open tool_use block's argument text
        self.calls = 0

    def feed(self, deltas: list[dict[str, Any]]) -> list[dict[str, Any]]:
        events: list[dict[str, Any]] = []
        for d in deltas:
            if d.get("reasoning_content"):
                events += self._write("thinking", {"type": "thinking", "thinking": "", "signature": ""},
                                      {"type": "thinking_delta", "thinking": d["reasoning_content"]})
            if d.get("content"):
                events += self._write("text", {"type": "text", "text": ""},
                                      {"type": "text_delta", "text": d["content"]})
            for call in d.get("tool_calls") or []:
                fn = call.get("function") or {}
                if "id" in call:  # a new call
                    events += self.close()
                    self.calls += 1
                    events += self._write("tool_use", {"type": "tool_use", "id": call["id"], "name": fn["name"],
                                                       "input": {}}, None)
                if fn.get("arguments"):
                    events += self._write("tool_use", {}, {"type": "input_json_delta",
                                                           "partial_json": fn["arguments"]})
        return events

    def _write(self, kind: str, start: dict[str, Any], delta: dict[str, Any] | None) -> list[dict[str, Any]]:
        events: list[dict[str, Any]] = []
        if self.open != kind or (kind == "tool_use" and start):
            events += self.close()
            self.open = kind
            self.blocks.append(dict(start))
            events.append({"type": "content_block_start", "index": len(self.blocks) - 1, "content_block": start})
        if delta is not None:
            block = self.blocks[-1]
            if kind == "tool_use":
                self.args.append(delta["partial_json"])
            else:
                block[kind] += delta[kind]
            events.append({"type": "content_block_delta", "index": len(self.blocks) - 1, "delta": delta})
        return events

    def close(self) -> list[dict[str, Any]]:
        if self.open is None:
            return []
        if self.open == "tool_use":
            text = "".join(self.args)
            try:
                self.blocks[-1]["input"] = json.loads(text) if text else {}
            except ValueError:
                self.blocks[-1]["input"] = {"arguments": text}  # not JSON (unconstrained output): kept whole
            self.args = []
        self.open = None
        return [{"type": "content_block_stop", "index": len(self.blocks) - 1}]


def stop_reason(meta: dict, calls: int, stop_sequences: list[str] | None) -> tuple[str, str | None]:
    """(stop_reason, stop_sequence) of an engine result."""
    reason = finish_reason_of(meta)
    if reason == "length":
        return "max_tokens", None
    matched = (meta.get("finish_reason") or {}).get("matched")
    if isinstance(matched, str) and matched in (stop_sequences or []):
        return "stop_sequence", matched
    return ("tool_use" if calls else "end_turn"), None


def usage(meta: dict) -> dict[str, int]:
    cached = meta.get("cached_tokens", 0)
    return {"input_tokens": meta["prompt_tokens"] - cached, "output_tokens": meta.get("completion_tokens", 0),
            "cache_creation_input_tokens": 0, "cache_read_input_tokens": cached}


class AnthropicServing:
    def __init__(self, api: OpenAIServing):
        self.api = api

    async def create(self, req: MessagesRequest, request: Request) -> Response:
        arrived = time.perf_counter()
        api = self.api
        chat = to_chat(req)
        jobs, spec, rid = await api.chat_api.prepare(chat, rid_prefix="msg_")
        head = {"id": rid, "type": "message", "role": "assistant", "model": req.model}
        if req.stream:
            streams = await api.start_stream(jobs, rid, arrived)
            return EventStream(self._stream(req, head, spec, streams), lambda: api.dispatcher.end_group(rid))
        (out,) = await api.run(request, jobs, rid, arrived)
        blocks = ContentBlocks()
        parsed = spec.choice()
        blocks.feed(parsed.feed(out["text"]) + parsed.finish())
        blocks.close()
        reason, sequence = stop_reason(out["meta_info"], blocks.calls, req.stop_sequences)
        return JSONResponse({**head, "content": blocks.blocks, "stop_reason": reason, "stop_sequence": sequence,
                             "usage": usage(out["meta_info"])})

    async def _stream(self, req: MessagesRequest, head: dict, spec: Any, streams: list) -> AsyncIterator[bytes]:
        blocks, parsed = ContentBlocks(), spec.choice()
        started = False
        try:
            async with aclosing(merge(streams)) as chunks:
                async for _, out in chunks:
                    meta = out["meta_info"]
                    if not started:  # the first chunk knows the prompt and its cached part
                        started = True
                        first = {**head, "content": [], "stop_reason": None, "stop_sequence": None,
                                 "usage": {**usage(meta), "output_tokens": 0}}
                        yield _event({"type": "message_start", "message": first})
                        yield _event({"type": "ping"})
                    for event in blocks.feed(parsed.feed(out.get("delta", ""))):
                        yield _event(event)
                    if meta.get("finish_reason") is None:
                        continue
                    for event in blocks.feed(parsed.finish()) + blocks.close():
                        yield _event(event)
                    reason, sequence = stop_reason(meta, blocks.calls, req.stop_sequences)
                    yield _event({"type": "message_delta", "delta": {"stop_reason": reason, "stop_sequence": sequence},
                                  "usage": usage(meta)})
                    yield _event({"type": "message_stop"})
        except Exception as e:  # noqa: BLE001 - the status line is sent: report it in the stream
            err = error_of(e)
            yield _event(anthropic_error(err.status, err.message))

    async def count_tokens(self, req: CountTokensRequest) -> Response:
        api = self.api
        chat = to_chat(req)
        api.admit(chat)
        with_tools = bool(chat.tools) and chat.effective_tool_choice != "none"
        text, images = await api.off_loop("messages", api.chat_api.render, chat, with_tools)
        if images:
            _, count = await api.engine.media_prompt(text, images)
        else:
            count = len(await api.encode(text, add_special_tokens=False))
        return JSONResponse({"input_tokens": count})


def anthropic_router(api: OpenAIServing, metrics: ServerMetrics) -> APIRouter:
    serving = AnthropicServing(api)
    router = APIRouter()

    @router.post("/v1/messages")
    async def messages(req: MessagesRequest, request: Request):
        metrics.requests.inc(api="anthropic")
        return await serving.create(req, request)

    @router.post("/v1/messages/count_tokens")
    async def count_tokens(req: CountTokensRequest):
        return await serving.count_tokens(req)

    return router
