"""/v1/responses (the OpenAI Responses API) on the chat machinery: the request becomes a chat request
(responses_input.py), runs as one chat choice (ChatServing.prepare: template, constraint, parsers), and its
deltas become output items and stream events (responses_output.py).

Stored responses (``store``, the default) are kept in memory, the newest STORE_LIMIT of them, so that
``previous_response_id`` continues a conversation (its input items and output, not its instructions, as
OpenAI's) and ``GET /v1/responses/{id}`` returns one; older ones are forgotten (then a 404).

The store is keyed by the API key's cache namespace as well as the id (--cache-isolation per-key): a response
stored under one key is invisible to every other key, which gets the same 404 as for an id never stored, and each
key keeps its own newest STORE_LIMIT (docs/security.md). With shared isolation every key is one namespace."""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import AsyncIterator
from contextlib import aclosing
from typing import TYPE_CHECKING, Any

import orjson
from starlette.requests import Request
from starlette.responses import Response

from radixgen.common.http_errors import APIError, JSONResponse, error_of
from radixgen.runtime.server.middleware import KEY_NAMESPACE
from radixgen.runtime.server.openai_stream import EventStream, finish_reason_of
from radixgen.runtime.server.responses_input import ResponsesRequest, to_chat
from radixgen.runtime.server.responses_output import ResponseOutput
from radixgen.runtime.server.serving import merge

if TYPE_CHECKING:
    from radixgen.runtime.server.openai_api import OpenAIServing

STORE_LIMIT = 512  # stored responses kept per key for previous_response_id (the oldest is dropped first)
_STATUS = {"stop": "completed", "length": "incomplete", "abort": "cancelled"}


def _event(event: dict[str, Any]) -> bytes:
    return b"event: " + event["type"].encode() + b"\ndata: " + orjson.dumps(event) + b"\n\n"


class ResponsesServing:
    def __init__(self, api: OpenAIServing):
        self.api = api
        # the key's namespace -> id -> {"response", "items"}: one key never sees another's, nor pushes them out
        self.stored: dict[str | None, OrderedDict[str, dict[str, Any]]] = {}

    def _mine(self) -> OrderedDict[str, dict[str, Any]]:
        return self.stored.setdefault(KEY_NAMESPACE.get(), OrderedDict())

    def store(self, response_id: str, record: dict[str, Any]) -> None:
        """Keep a response for the calling key; its newest STORE_LIMIT are kept (other keys' do not count)."""
        mine = self._mine()
        mine[response_id] = record
        while len(mine) > STORE_LIMIT:
            mine.popitem(last=False)

    def _kept(self, response_id: str, param: str) -> dict[str, Any]:
        """The stored response `response_id` of the calling key; a 404 for one never stored, forgotten or
        stored under another key alike (the message does not tell them apart)."""
        kept = self._mine().get(response_id)
        if kept is None:
            raise APIError(404, f"Response with id '{response_id[:200]}' not found (responses are kept in memory, "
                           f"the newest {STORE_LIMIT}, when stored).", param)
        return kept

    # ------------------------------------------------------------ the request

    def _history(self, req: ResponsesRequest) -> list[dict[str, Any]]:
        if req.previous_response_id is None:
            return []
        return list(self._kept(req.previous_response_id, "previous_response_id")["items"])

    async def create(self, req: ResponsesRequest, request: Request) -> Response:
        arrived = time.perf_counter()
        history = self._history(req)
        chat = to_chat(req, history)
        jobs, spec, rid = await self.api.chat_api.prepare(chat, rid_prefix="resp_")
        head = self._head(req, chat, rid)
        inputs = history + ([{"role": "user", "content": req.input}] if isinstance(req.input, str) else req.input)
        if req.stream:
            streams = await self.api.start_stream(jobs, rid, arrived)
            body = self._stream(req, head, inputs, spec, streams)
            return EventStream(body, lambda: self.api.dispatcher.end_group(rid))
        (out,) = await self.api.run(request, jobs, rid, arrived)
        parsed, built = spec.choice(), ResponseOutput()
        built.feed(parsed.feed(out["text"]) + parsed.finish())
        reason = finish_reason_of(out["meta_info"])
        built.close("incomplete" if reason == "length" else "completed")
        return JSONResponse(self._finish(req, head, inputs, built, out, reason))

    async def _stream(self, req: ResponsesRequest, head: dict, inputs: list, spec: Any,
                      streams: list) -> AsyncIterator[bytes]:
        seq = 0

        def send(event: dict[str, Any]) -> bytes:
            nonlocal seq
            event["sequence_number"] = seq
            seq += 1
            return _event(event)

        parsed, built = spec.choice(), ResponseOutput()
        try:
            start = {**head, "status": "in_progress", "output": [], "usage": None}
            yield send({"type": "response.created", "response": start})
            yield send({"type": "response.in_progress", "response": start})
            async with aclosing(merge(streams)) as chunks:
                async for _, out in chunks:
                    for event in built.feed(parsed.feed(out.get("delta", ""))):
                        yield send(event)
                    if out["meta_info"].get("finish_reason") is None:
                        continue
                    reason = finish_reason_of(out["meta_info"])
                    for event in built.feed(parsed.finish()) + built.close(
                            "incomplete" if reason == "length" else "completed"):
                        yield send(event)
                    final = self._finish(req, head, inputs, built, out, reason)
                    kind = {"completed": "response.completed", "incomplete": "response.incomplete"}.get(
                        final["status"], "response.failed")
                    yield send({"type": kind, "response": final})
        except Exception as e:  # noqa: BLE001 - the status line is sent: report it in the stream
            err = error_of(e).body()["error"]
            yield send({"type": "error", "code": err["code"], "message": err["message"], "param": err["param"]})

    # ------------------------------------------------------------ the response object

    def _head(self, req: ResponsesRequest, chat: Any, rid: str) -> dict[str, Any]:
        """The fields of a response that echo its request."""
        fmt = (req.text or {}).get("format") or {"type": "text"}
        tools = [{"type": "function", "name": t.function.name, "description": t.function.description,
                  "parameters": t.function.parameters, "strict": t.function.strict} for t in chat.tools or []]
        choice = req.tool_choice if req.tool_choice is not None else ("auto" if tools else "none")
        return {
            "id": rid, "object": "response", "created_at": int(time.time()), "model": self.api.response_model(chat),
            "instructions": req.instructions, "max_output_tokens": req.max_output_tokens,
            "parallel_tool_calls": chat.parallel_tool_calls, "previous_response_id": req.previous_response_id,
            "reasoning": {"effort": (req.reasoning or {}).get("effort"), "summary": None}, "store": req.store,
            "temperature": req.temperature, "top_p": req.top_p, "text": {"format": fmt}, "tool_choice": choice,
            "tools": tools, "truncation": "disabled", "metadata": req.metadata or {}, "user": req.user,
            "error": None, "incomplete_details": None,
        }

    def _finish(self, req: ResponsesRequest, head: dict, inputs: list, built: ResponseOutput, out: dict,
                reason: str) -> dict[str, Any]:
        meta = out["meta_info"]
        thought = built.reasoning_text()
        reasoning_tokens = len(self.api.tokenizer.encode(thought, add_special_tokens=False)) if thought else 0
        usage = {"input_tokens": meta["prompt_tokens"],
                 "input_tokens_details": {"cached_tokens": meta.get("cached_tokens", 0)},
                 "output_tokens": meta["completion_tokens"],
                 "output_tokens_details": {"reasoning_tokens": min(reasoning_tokens, meta["completion_tokens"])},
                 "total_tokens": meta["prompt_tokens"] + meta["completion_tokens"]}
        status = _STATUS.get(reason, "incomplete")
        response = {**head, "status": status, "output": built.items, "usage": usage,
                    "incomplete_details": {"reason": "max_output_tokens"} if reason == "length" else None}
        if req.store:
            self.store(head["id"], {"response": response, "items": [*inputs, *built.items]})
        return response

    def retrieve(self, response_id: str) -> dict[str, Any]:
        return self._kept(response_id, "response_id")["response"]

    def delete(self, response_id: str) -> dict[str, Any]:
        """DELETE /v1/responses/{id}: forget a stored response of the calling key."""
        self._kept(response_id, "response_id")
        del self._mine()[response_id]
        return {"id": response_id, "object": "response", "deleted": True}
