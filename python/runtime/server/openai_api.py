"""The OpenAI-compatible API: /v1/models, /v1/completions, /v1/chat/completions.

Each (prompt, choice) pair is one engine request with n=1 (choice j of a seeded request gets seed + j),
so streamed and non-streamed requests take the same path and give the same text."""

from __future__ import annotations

import json
import math
import time
from collections.abc import AsyncIterator, Callable
from contextlib import aclosing
from functools import lru_cache
from typing import Any, NamedTuple

import orjson
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from radixgen.runtime.server.errors import APIError, JSONResponse, bad_request, error_of
from radixgen.runtime.server.protocol import (
    ChatCompletionRequest,
    ChatMessage,
    CompletionRequest,
    NamedToolChoice,
    SamplingFields,
)
from radixgen.runtime.server.serving import Dispatcher, merge, new_rid, until_disconnect
from radixgen.runtime.server.tools import (
    AutoToolStream,
    ParsedCalls,
    format_call,
    parse_auto,
    parse_constrained,
    tool_choice_schema,
    tools_system_prompt,
)

FLOOR_LOGPROB = -9999.0  # what -inf becomes: JSON has no infinities


class Job(NamedTuple):
    """One engine request: prompt `prompt` of the API request, choice `choice` of its n."""

    index: int  # the OpenAI choice index: prompt * n + choice
    prompt: int
    rid: str
    kwargs: dict[str, Any]


def sse(obj: Any) -> bytes:
    return b"data: " + orjson.dumps(obj) + b"\n\n"


SSE_DONE = b"data: [DONE]\n\n"


class EventStream(StreamingResponse):
    """An SSE response that closes its body generator however the response ends (so the generator's
    cleanup runs at once), then calls `cleanup` (which aborts whatever of the request still runs)."""

    def __init__(self, content: AsyncIterator[bytes], cleanup: Callable[[], Any]):
        super().__init__(content, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        self.cleanup = cleanup

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.body_iterator.aclose()
            self.cleanup()


def _logprob(x: float | None) -> float | None:
    if x is None:
        return None
    return FLOOR_LOGPROB if math.isinf(x) or math.isnan(x) else x


def finish_reason_of(meta: dict) -> str:
    """The OpenAI finish_reason of an engine result: "stop", "length", or "abort" (by /abort_request or
    at shutdown; requests the runtime rejects raise in the engine instead)."""
    return (meta.get("finish_reason") or {}).get("type", "abort")


class OpenAIServing:
    def __init__(self, engine: Any, dispatcher: Dispatcher, served_model_name: str):
        self.engine = engine
        self.dispatcher = dispatcher
        self.tokenizer = engine.tokenizer
        info = engine.model_info
        self.context_length = int(info["context_length"])
        self.vocab_size = int(info["vocab_size"])
        self.model_name = served_model_name
        self.model_path = str(info.get("model_path", ""))
        self.created = int(time.time())
        template = self.tokenizer.chat_template or ""
        self.template_renders_tools = "tools" in template  # else tools go into a system message
        self.token_text = lru_cache(maxsize=65536)(self._token_text)

    def _token_text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id])

    # ------------------------------------------------------------ models

    def model_card(self) -> dict:
        return {
            "id": self.model_name,
            "object": "model",
            "created": self.created,
            "owned_by": "radixgen",
            "root": self.model_path,
            "max_model_len": self.context_length,
        }

    def list_models(self) -> dict:
        return {"object": "list", "data": [self.model_card()]}

    def retrieve_model(self, model_id: str) -> dict:
        self.check_model(model_id)
        return self.model_card()

    def check_model(self, name: str | None) -> None:
        if name is not None and name != self.model_name:
            raise APIError(404, f"The model `{name}` does not exist.", "model", "model_not_found")

    # ------------------------------------------------------------ shared request building

    def check_ids(self, ids: list[int], param: str) -> None:
        for t in ids:
            if not 0 <= t < self.vocab_size:
                raise bad_request(
                    f"{param}: token id {t} is out of vocabulary (vocab_size={self.vocab_size})", param
                )

    def budget(self, prompt_len: int, requested: int | None, param: str, prompt_param: str) -> int:
        """max_new_tokens for a prompt: as asked, or what the context leaves; 400 when it does not fit."""
        room = self.context_length - prompt_len
        limit = f"This model's maximum context length is {self.context_length} tokens; the prompt has"
        limit += f" {prompt_len}"
        if room <= 0:
            raise bad_request(f"{limit} tokens.", prompt_param)
        if requested is None:
            return room
        if requested > room:
            raise bad_request(f"{limit} tokens and {param}={requested} more were requested.", param)
        return requested

    @staticmethod
    def sampling(req: SamplingFields, max_new_tokens: int, constraint: dict[str, str]) -> dict[str, Any]:
        sp: dict[str, Any] = {
            "max_new_tokens": max_new_tokens,
            "min_new_tokens": req.min_tokens,
            "temperature": 1.0 if req.temperature is None else req.temperature,
            "top_p": 1.0 if req.top_p is None else req.top_p,
            "frequency_penalty": req.frequency_penalty,
            "presence_penalty": req.presence_penalty,
            "stop": [req.stop] if isinstance(req.stop, str) else list(req.stop or []),
            "ignore_eos": req.ignore_eos,
            "skip_special_tokens": req.skip_special_tokens,
            "no_stop_trim": req.no_stop_trim,
        }
        for name in ("top_k", "min_p", "repetition_penalty", "stop_token_ids"):
            value = getattr(req, name)
            if value is not None:
                sp[name] = value
        sp.update(constraint)
        return sp

    @staticmethod
    def constraint(req: SamplingFields, **more: dict | str | None) -> dict[str, str]:
        """The one output constraint of a request; 400 when several are given."""
        given = {"regex": req.regex, "json_schema": req.json_schema, "ebnf": req.ebnf, **more}
        given = {k: v for k, v in given.items() if v is not None}
        if len(given) > 1:
            raise bad_request(
                f"at most one output constraint may be given; got {sorted(given)}", sorted(given)[1]
            )
        if not given:
            return {}
        name, value = next(iter(given.items()))
        kind = name if name in ("regex", "ebnf") else "json_schema"  # response_format, tools: schemas
        return {kind: json.dumps(value) if isinstance(value, dict) else value}

    def jobs(
        self, prompts: list[list[int]], req: SamplingFields, sp: list[dict], rid: str, **kw
    ) -> list[Job]:
        n = req.n
        out = []
        for p, ids in enumerate(prompts):
            for j in range(n):
                params = dict(sp[p])
                if req.seed is not None:
                    params["seed"] = req.seed + j  # distinct, reproducible samples per choice
                k = p * n + j
                job_rid = rid if len(prompts) * n == 1 else f"{rid}-{k}"
                out.append(Job(k, p, job_rid, {"input_ids": ids, "sampling_params": params, **kw}))
        return out

    async def start_stream(self, jobs: list[Job], group: str, arrived: float) -> list[AsyncIterator[dict]]:
        self.dispatcher.open_group(group, [j.rid for j in jobs])
        try:
            return await self.dispatcher.open([(j.rid, j.kwargs) for j in jobs], arrived, prime=True)
        except BaseException:
            self.dispatcher.end_group(group)
            raise

    async def run(self, request: Request, jobs: list[Job], group: str, arrived: float) -> list[dict]:
        """Final results of all jobs, in order; aborted when the client disconnects."""
        self.dispatcher.open_group(group, [j.rid for j in jobs])

        async def collect() -> list[dict]:
            results: list[dict | None] = [None] * len(jobs)
            streams = await self.dispatcher.open([(j.rid, j.kwargs) for j in jobs], arrived)
            async with aclosing(merge(streams)) as chunks:
                async for i, chunk in chunks:
                    results[i] = chunk
            return results  # type: ignore[return-value]

        try:
            return await until_disconnect(request, collect())
        finally:
            self.dispatcher.end_group(group)

    def usage(self, outs: list[dict], n: int) -> dict:
        """Prompt and cached tokens count once per prompt (its first choice); completion tokens all."""
        firsts = [o["meta_info"] for o in outs[::n]]
        prompt = sum(m["prompt_tokens"] for m in firsts)
        completion = sum(o["meta_info"]["completion_tokens"] for o in outs)
        return {
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": sum(m.get("cached_tokens", 0) for m in firsts)},
        }

    # ------------------------------------------------------------ /v1/completions

    def completion_prompts(self, req: CompletionRequest) -> tuple[list[list[int]], list[str]]:
        p = req.prompt
        if isinstance(p, str):
            texts = [p]
        elif all(isinstance(x, str) for x in p):
            texts = list(p)
        else:
            ids_list = [p] if isinstance(p[0], int) else p
            for ids in ids_list:
                if not ids:
                    raise bad_request("prompt: a token-id prompt must not be empty", "prompt")
                self.check_ids(ids, "prompt")
            return [list(x) for x in ids_list], [self.tokenizer.decode(x) for x in ids_list]
        return [self.tokenizer.encode(t) for t in texts], texts

    async def completions(self, req: CompletionRequest, request: Request) -> Response:
        arrived = time.perf_counter()
        self.check_model(req.model)
        prompts, texts = self.completion_prompts(req)
        for ids in prompts:
            if not ids:
                raise bad_request("prompt: must not be empty", "prompt")
        constraint = self.constraint(req)
        sps = [
            self.sampling(req, self.budget(len(ids), req.max_tokens, "max_tokens", "prompt"), constraint)
            for ids in prompts
        ]
        want_lp = req.logprobs is not None
        rid = req.rid or new_rid("cmpl-")
        jobs = self.jobs(
            prompts,
            req,
            sps,
            rid,
            return_logprob=want_lp,
            top_logprobs_num=req.logprobs or 0,
            logprob_start_len=0 if (want_lp and req.echo) else -1,
        )
        if req.stream:
            streams = await self.start_stream(jobs, rid, arrived)
            return EventStream(
                self.stream_completions(req, jobs, streams, texts, rid),
                lambda: self.dispatcher.end_group(rid),
            )
        outs = await self.run(request, jobs, rid, arrived)
        choices = []
        for job, out in zip(jobs, outs, strict=True):
            meta = out["meta_info"]
            prefix = texts[job.prompt] if req.echo else ""
            lp = None
            if want_lp:
                start = 0 if req.echo else len(texts[job.prompt])
                lp = self.completion_logprobs(meta, req.echo, True, start)
            choices.append(
                {
                    "index": job.index,
                    "text": prefix + out["text"],
                    "logprobs": lp,
                    "finish_reason": finish_reason_of(meta),
                }
            )
        return JSONResponse(
            {
                "id": rid,
                "object": "text_completion",
                "created": int(time.time()),
                "model": self.model_name,
                "choices": choices,
                "usage": self.usage(outs, req.n),
            }
        )

    def completion_logprobs(
        self, meta: dict, with_input: bool, with_output: bool, offset: int, out_from: int = 0
    ) -> dict:
        """The legacy completions logprobs object over the prompt tokens (echo) and/or output tokens
        [out_from, ...)."""
        pairs: list[tuple[tuple, list | None]] = []
        if with_input:
            inp = meta.get("input_token_logprobs") or []
            tops = meta.get("input_top_logprobs") or [None] * len(inp)
            pairs += list(zip(inp, tops, strict=True))
        if with_output:
            outp = (meta.get("output_token_logprobs") or [])[out_from:]
            tops = (meta.get("output_top_logprobs") or [None] * (out_from + len(outp)))[out_from:]
            pairs += list(zip(outp, tops, strict=True))
        tokens, token_logprobs, top_logprobs, offsets = [], [], [], []
        for (lp, tid, *_), top in pairs:
            s = self.token_text(tid)
            tokens.append(s)
            token_logprobs.append(_logprob(lp))
            offsets.append(offset)
            offset += len(s)
            top_logprobs.append(
                None if top is None else {self.token_text(t): _logprob(x) for x, t, *_ in top}
            )
        return {
            "tokens": tokens,
            "token_logprobs": token_logprobs,
            "top_logprobs": top_logprobs,
            "text_offset": offsets,
        }

    async def stream_completions(
        self, req: CompletionRequest, jobs: list[Job], streams: list, texts: list[str], rid: str
    ) -> AsyncIterator[bytes]:
        created = int(time.time())
        want_lp = req.logprobs is not None
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        head = {"id": rid, "object": "text_completion", "created": created, "model": self.model_name}

        def chunk(index: int, text: str, lp: dict | None, finish: str | None) -> bytes:
            choice = {"index": index, "text": text, "logprobs": lp, "finish_reason": finish}
            return sse({**head, "choices": [choice], **({"usage": None} if include_usage else {})})

        finals: list[dict | None] = [None] * len(jobs)
        sent_lp = [0] * len(jobs)
        offsets = [0 if req.echo else len(texts[j.prompt]) for j in jobs]
        started = [False] * len(jobs)
        try:
            async with aclosing(merge(streams)) as events:
                async for i, out in events:
                    job, meta = jobs[i], out["meta_info"]
                    if not started[i] and req.echo:  # the prompt (and its logprobs) come first
                        lp = self.completion_logprobs(meta, True, False, 0) if want_lp else None
                        offsets[i] = len(texts[job.prompt])
                        yield chunk(job.index, texts[job.prompt], lp, None)
                    started[i] = True
                    finish = None
                    if meta.get("finish_reason") is not None:
                        finish = finish_reason_of(meta)
                        finals[i] = out
                    delta = out.get("delta", "")
                    lp = None
                    if want_lp:
                        lp = self.completion_logprobs(meta, False, True, offsets[i], sent_lp[i])
                        sent_lp[i] += len(lp["tokens"])
                    offsets[i] += len(delta)
                    if delta or finish or (lp and lp["tokens"]):
                        yield chunk(job.index, delta, lp, finish)
            if include_usage:
                yield sse({**head, "choices": [], "usage": self.usage(finals, req.n)})
        except Exception as e:  # noqa: BLE001 - the status line is sent: report it in the stream
            yield sse(error_of(e).body())
        yield SSE_DONE

    # ------------------------------------------------------------ /v1/chat/completions

    def template_messages(self, req: ChatCompletionRequest, with_tools: bool) -> list[dict]:
        msgs = []
        for i, m in enumerate(req.messages):
            content = self.message_text(m, i)
            d: dict[str, Any] = {"role": "system" if m.role == "developer" else m.role, "content": content}
            if m.name is not None:
                d["name"] = m.name
            if m.tool_call_id is not None:
                d["tool_call_id"] = m.tool_call_id
            if m.tool_calls:
                if self.template_renders_tools:
                    d["tool_calls"] = [
                        {
                            "id": c.id,
                            "type": "function",
                            "function": {
                                "name": c.function.name,
                                "arguments": _json_or_text(c.function.arguments),
                            },
                        }
                        for c in m.tool_calls
                    ]
                else:  # the template cannot render calls: write them in the format the model was told
                    calls = "".join(
                        format_call(c.function.name, _json_or_text(c.function.arguments))
                        for c in m.tool_calls
                    )
                    d["content"] = content + calls
            msgs.append(d)
        if with_tools and not self.template_renders_tools:
            note = tools_system_prompt(req.tools or [])
            if msgs[0]["role"] == "system":
                msgs[0] = {**msgs[0], "content": msgs[0]["content"] + "\n\n" + note}
            else:
                msgs.insert(0, {"role": "system", "content": note})
        return msgs

    @staticmethod
    def message_text(m: ChatMessage, i: int) -> str:
        if m.content is None:
            if m.role == "assistant" and m.tool_calls:
                return ""
            raise bad_request(f"messages[{i}].content: required for role {m.role!r}", "messages")
        if isinstance(m.content, str):
            return m.content
        parts = []
        for part in m.content:
            if part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise bad_request(
                    f"messages[{i}].content: only text parts are supported, got type {part.get('type')!r}",
                    "messages",
                )
            parts.append(part["text"])
        return "".join(parts)

    def chat_prompt(self, req: ChatCompletionRequest, with_tools: bool) -> list[int]:
        msgs = self.template_messages(req, with_tools)
        kwargs: dict[str, Any] = {}
        if with_tools and self.template_renders_tools:
            kwargs["tools"] = [t.model_dump(exclude_none=True) for t in req.tools or []]
        try:
            text = self.tokenizer.apply_chat_template(
                msgs, add_generation_prompt=True, tokenize=False, **kwargs
            )
        except Exception as e:  # noqa: BLE001 - jinja raises its own kinds for bad message shapes
            raise bad_request(f"messages: the chat template could not be applied: {e}", "messages") from e
        # the template writes the special tokens itself
        return self.tokenizer.encode(text, add_special_tokens=False)

    async def chat(self, req: ChatCompletionRequest, request: Request) -> Response:
        arrived = time.perf_counter()
        self.check_model(req.model)
        choice = req.effective_tool_choice
        with_tools = bool(req.tools) and choice != "none"
        ids = self.chat_prompt(req, with_tools)
        fmt = None
        if req.response_format is not None and req.response_format.type != "text":
            fmt = (
                {"type": "object"}
                if req.response_format.type == "json_object"
                else (
                    req.response_format.json_schema.schema_  # type: ignore[union-attr]
                )
            )
        tool_schema = tool_choice_schema(req.tools, choice, req.parallel_tool_calls) if with_tools else None
        constraint = self.constraint(req, response_format=fmt, tool_choice=tool_schema)
        requested = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        param = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
        sp = self.sampling(req, self.budget(len(ids), requested, param, "messages"), constraint)
        rid = req.rid or new_rid("chatcmpl-")
        jobs = self.jobs(
            [ids],
            req,
            [sp],
            rid,
            return_logprob=req.logprobs,
            top_logprobs_num=req.top_logprobs or 0,
            logprob_start_len=-1,
        )
        mode = ChatToolMode(req, choice if with_tools else "none")
        if req.stream:
            streams = await self.start_stream(jobs, rid, arrived)
            return EventStream(
                self.stream_chat(req, jobs, streams, mode, rid), lambda: self.dispatcher.end_group(rid)
            )
        outs = await self.run(request, jobs, rid, arrived)
        choices = []
        for job, out in zip(jobs, outs, strict=True):
            meta = out["meta_info"]
            finish = finish_reason_of(meta)
            parsed = mode.parse(out["text"])
            message: dict[str, Any] = {"role": "assistant", "content": parsed.content, "refusal": None}
            if parsed.calls:
                message["tool_calls"] = parsed.calls
                finish = "tool_calls"
            lp = {"content": self.chat_logprobs(meta), "refusal": None} if req.logprobs else None
            choices.append({"index": job.index, "message": message, "logprobs": lp, "finish_reason": finish})
        return JSONResponse(
            {
                "id": rid,
                "object": "chat.completion",
                "created": int(time.time()),
                "model": self.model_name,
                "choices": choices,
                "usage": self.usage(outs, req.n),
            }
        )

    def chat_logprobs(self, meta: dict, start: int = 0) -> list[dict]:
        outp = (meta.get("output_token_logprobs") or [])[start:]
        tops = (meta.get("output_top_logprobs") or [None] * (start + len(outp)))[start:]
        entries = []
        for (lp, tid, *_), top in zip(outp, tops, strict=True):
            s = self.token_text(tid)
            entries.append(
                {
                    "token": s,
                    "logprob": _logprob(lp),
                    "bytes": list(s.encode()),
                    "top_logprobs": [
                        {
                            "token": self.token_text(t),
                            "logprob": _logprob(x),
                            "bytes": list(self.token_text(t).encode()),
                        }
                        for x, t, *_ in top or []
                    ],
                }
            )
        return entries

    async def stream_chat(
        self, req: ChatCompletionRequest, jobs: list[Job], streams: list, mode: ChatToolMode, rid: str
    ) -> AsyncIterator[bytes]:
        created = int(time.time())
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        head = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": self.model_name}

        def chunk(index: int, delta: dict, lp: list | None = None, finish: str | None = None) -> bytes:
            logprobs = None if lp is None else {"content": lp, "refusal": None}
            choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
            return sse({**head, "choices": [choice], **({"usage": None} if include_usage else {})})

        finals: list[dict | None] = [None] * len(jobs)
        sent_lp = [0] * len(jobs)
        filters = [mode.stream_filter() for _ in jobs]
        try:
            for job in jobs:  # the first delta of each choice carries the role
                yield chunk(job.index, {"role": "assistant", "content": ""})
            async with aclosing(merge(streams)) as events:
                async for i, out in events:
                    job, meta = jobs[i], out["meta_info"]
                    lp = None
                    if req.logprobs:
                        lp = self.chat_logprobs(meta, sent_lp[i])
                        sent_lp[i] += len(lp)
                    text = filters[i].feed(out.get("delta", ""))
                    if text or lp:
                        yield chunk(job.index, {"content": text} if text else {}, lp)
                    if meta.get("finish_reason") is None:
                        continue
                    finals[i] = out
                    finish = finish_reason_of(meta)
                    rest = filters[i].finish(out["text"])
                    if rest.content:
                        yield chunk(job.index, {"content": rest.content})
                    if rest.calls:
                        calls = [{"index": k, **c} for k, c in enumerate(rest.calls)]
                        yield chunk(job.index, {"tool_calls": calls})
                        finish = "tool_calls"
                    yield chunk(job.index, {}, None, finish)
            if include_usage:
                yield sse({**head, "choices": [], "usage": self.usage(finals, req.n)})
        except Exception as e:  # noqa: BLE001 - the status line is sent: report it in the stream
            yield sse(error_of(e).body())
        yield SSE_DONE


def _json_or_text(arguments: str) -> Any:
    try:
        return json.loads(arguments)
    except ValueError:
        return arguments


class ChatToolMode:
    """How a chat choice's text becomes content and tool_calls, for its tool_choice."""

    def __init__(self, req: ChatCompletionRequest, choice: str | NamedToolChoice):
        self.tools = req.tools or []
        self.choice = choice
        self.parallel = req.parallel_tool_calls

    def parse(self, text: str) -> ParsedCalls:
        if self.choice == "none":
            return ParsedCalls(text, [])
        if self.choice == "auto":
            return parse_auto(text, self.tools)
        parsed = parse_constrained(text, self.tools, self.choice, self.parallel)
        return parsed if parsed is not None else ParsedCalls(text, [])

    def stream_filter(self) -> _StreamFilter:
        return _StreamFilter(self)


class _StreamFilter:
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
