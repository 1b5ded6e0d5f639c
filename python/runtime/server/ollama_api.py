"""Ollama's API: /api/chat and /api/generate (NDJSON streams, the default, or one JSON object), /api/tags,
/api/ps, /api/show, /api/version. Chat, and generate unless `raw`, run on the chat path (chat template,
tools, reasoning parser, `format` on the constraint engine); a raw generate is a plain completion. A choice's
deltas become `content` / `thinking` lines; tool calls are sent whole (Ollama's shape: arguments as an
object) in the last line before `done`. A whole response is the stream folded into one object.

`prompt_eval_count` counts the prompt tokens computed for this request: those the radix cache already held
are not evaluated again (as Ollama counts a reused prefix). Durations are nanoseconds. Errors are Ollama's
{"error": "..."} (api_errors.py), in a stream a line of that shape."""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import AsyncIterator
from contextlib import aclosing
from datetime import datetime, timezone
from importlib.metadata import version
from pathlib import Path
from typing import TYPE_CHECKING, Any

import orjson
from fastapi import APIRouter, Request
from starlette.responses import Response, StreamingResponse

from radixgen.common.http_errors import APIError, JSONResponse, bad_request, error_of
from radixgen.runtime.server.api_errors import ErrorShape
from radixgen.runtime.server.ollama_protocol import (
    OllamaChat,
    OllamaGenerate,
    OllamaShow,
    Options,
    chat_request,
    check_chat,
    check_generate,
    completion_request,
)
from radixgen.runtime.server.openai_stream import EventStream, Job, finish_reason_of
from radixgen.runtime.server.serving import merge, until_disconnect

if TYPE_CHECKING:
    from radixgen.runtime.server.metrics import ServerMetrics
    from radixgen.runtime.server.openai_api import OpenAIServing

ERROR_SHAPE = ErrorShape("/api", lambda status, message, code: {"error": message})


def _now() -> str:
    return datetime.now(timezone.utc).isoformat().replace("+00:00", "Z")


class NDJSONStream(EventStream):
    def __init__(self, content: AsyncIterator[bytes], cleanup: Any):
        StreamingResponse.__init__(self, content, media_type="application/x-ndjson")
        self.cleanup = cleanup


class Reply:
    """One choice's deltas as Ollama's fields: text and thinking as they come, calls once whole."""

    def __init__(self) -> None:
        self.calls: list[dict[str, Any]] = []
        self.args: list[str] = []

    def feed(self, deltas: list[dict[str, Any]]) -> tuple[str, str]:
        text, thinking = [], []
        for d in deltas:
            thinking.append(d.get("reasoning_content") or "")
            text.append(d.get("content") or "")
            for call in d.get("tool_calls") or []:
                fn = call.get("function") or {}
                if "id" in call:
                    self.calls.append({"function": {"index": len(self.calls), "name": fn["name"]}})
                    self.args.append("")
                self.args[-1] += fn.get("arguments") or ""
        return "".join(text), "".join(thinking)

    def tool_calls(self) -> list[dict[str, Any]]:
        for call, args in zip(self.calls, self.args, strict=True):
            try:
                call["function"]["arguments"] = json.loads(args) if args else {}
            except ValueError:
                call["function"]["arguments"] = {"arguments": args}  # not JSON (unconstrained output): kept whole
        return self.calls


class OllamaServing:
    def __init__(self, api: OpenAIServing):
        self.api = api
        self.created = _now()

    # ------------------------------------------------------------ generation

    def _check_think(self, req: OllamaChat | OllamaGenerate) -> None:
        if req.think not in (None, False) and self.api.chat_api.reasoning is None:
            raise bad_request(f'"{req.model}" does not support thinking (the served model has no reasoning format; '
                              f"see --reasoning-parser)")

    async def chat(self, req: OllamaChat, request: Request) -> Response:
        check_chat(req)
        self._check_think(req)
        opts = Options(req.options, self.api.context_length)
        jobs, spec, rid, requested = await self._prepare_chat(chat_request(req, req.messages, opts))
        self._fit(jobs, [], opts, requested)
        return await self._respond(request, jobs, rid, spec, req, "chat")

    async def generate(self, req: OllamaGenerate, request: Request) -> Response:
        check_generate(req)
        self._check_think(req)
        if not req.prompt and not req.images:  # Ollama's way of loading a model: it is always loaded here
            return JSONResponse({"model": req.model, "created_at": _now(), "response": "", "done": True,
                                 "done_reason": "load"})
        opts = Options(req.options, self.api.context_length)
        context = list(req.context or [])
        self.api.check_ids(context, "context")
        if req.raw:
            comp = completion_request(req, opts)
            lora = self.api.admit(comp)
            ids = await self.api.encode(req.prompt, add_special_tokens=not context)
            rid = self.api.request_id(comp, "ollama-")
            sp = self.api.sampling(comp, 1, self.api.constraint(
                comp, response_format=None if req.format in (None, "") else
                ({"type": "object"} if req.format == "json" else req.format)))
            jobs = self.api.jobs([ids], comp, [sp], rid, lora=lora)
            self._fit(jobs, context, opts, comp.max_tokens)
            return await self._respond(request, jobs, rid, None, req, "generate")
        messages = ([{"role": "system", "content": req.system}] if req.system else []) + [
            {"role": "user", "content": req.prompt, **({"images": req.images} if req.images else {})}]
        jobs, spec, rid, requested = await self._prepare_chat(chat_request(req, messages, opts))
        self._fit(jobs, context, opts, requested)
        return await self._respond(request, jobs, rid, spec, req, "generate")

    async def _prepare_chat(self, chat: Any) -> tuple[list[Job], Any, str, int | None]:
        """The chat path's jobs with the budget left to _fit: prepared without max_tokens, so that their
        max_new_tokens is what the model's context leaves (how long a prompt with images is, in tokens)."""
        requested = chat.max_tokens
        jobs, spec, rid = await self.api.chat_api.prepare(chat.model_copy(update={"max_tokens": None}),
                                                          rid_prefix="ollama-")
        return jobs, spec, rid, requested

    def _fit(self, jobs: list[Job], context: list[int], opts: Options, requested: int | None) -> None:
        """The prompt after the `context` ids of an earlier generate, and the token budget inside num_ctx."""
        kwargs = jobs[0].kwargs
        sp = kwargs["sampling_params"]
        if "input_ids" in kwargs:
            kwargs["input_ids"] = context + kwargs["input_ids"]
            prompt_len = len(kwargs["input_ids"])
        elif context:
            raise bad_request("context: not supported with images by this server")
        else:  # a prompt with images, prepared without max_tokens: it leaves max_new_tokens of the context
            prompt_len = self.api.context_length - sp["max_new_tokens"]
        limit = opts.num_ctx or self.api.context_length
        room = limit - prompt_len
        if room <= 0 or (requested is not None and requested > room):
            raise bad_request(f"the prompt has {prompt_len} tokens" + (f" and num_predict={requested} more were "
                              f"requested" if room > 0 else "") + f"; the context window is {limit} tokens")
        sp["max_new_tokens"] = room if requested is None else requested

    async def _respond(self, request: Request, jobs: list[Job], rid: str, spec: Any,
                       req: OllamaChat | OllamaGenerate, kind: str) -> Response:
        arrived = time.perf_counter()
        streams = await self.api.start_stream(jobs, rid, arrived)
        lines = self._lines(streams, spec, req, kind, arrived, jobs[0].kwargs.get("input_ids"))
        if req.stream:
            async def body() -> AsyncIterator[bytes]:
                async with aclosing(lines) as it:
                    async for line in it:
                        yield orjson.dumps({"error": line["error"]} if "error" in line else line) + b"\n"

            return NDJSONStream(body(), lambda: self.api.dispatcher.end_group(rid))

        async def fold() -> dict[str, Any]:
            whole: dict[str, Any] = {}
            async with aclosing(lines) as it:
                async for line in it:
                    if "error" in line:
                        raise APIError(line["status"], line["error"])
                    whole = _fold(whole, line, kind)
            return whole

        try:
            return JSONResponse(await until_disconnect(request, fold()))
        finally:
            self.api.dispatcher.end_group(rid)

    async def _lines(self, streams: list, spec: Any, req: OllamaChat | OllamaGenerate, kind: str, arrived: float,
                     prompt_ids: list[int] | None) -> AsyncIterator[dict[str, Any]]:
        reply, parsed = Reply(), spec.choice() if spec is not None else None
        first = None

        def line(text: str, thinking: str) -> dict[str, Any]:
            out: dict[str, Any] = {"model": req.model, "created_at": _now()}
            if kind == "chat":
                out["message"] = {"role": "assistant", "content": text, **({"thinking": thinking} if thinking else {})}
            else:
                out.update(response=text, **({"thinking": thinking} if thinking else {}))
            return {**out, "done": False}

        try:
            async with aclosing(merge(streams)) as chunks:
                async for _, out in chunks:
                    meta = out["meta_info"]
                    if first is None and meta.get("completion_tokens"):
                        first = time.perf_counter()
                    delta = out.get("delta", "")
                    done = meta.get("finish_reason") is not None
                    if parsed is None:
                        text, thinking = delta, ""
                    else:
                        text, thinking = reply.feed(parsed.feed(delta) + (parsed.finish() if done else []))
                    if text or thinking:
                        yield line(text, thinking)
                    if not done:
                        continue
                    end = line("", "")
                    if reply.calls:
                        end["message"]["tool_calls"] = reply.tool_calls()
                        yield end
                        end = line("", "")
                    yield {**end, **self._stats(meta, arrived, first, kind, prompt_ids, out.get("output_ids"))}
        except Exception as e:  # noqa: BLE001 - the status line is sent: report it in the stream
            err = error_of(e)
            yield {"error": err.message, "status": err.status}

    @staticmethod
    def _stats(meta: dict, arrived: float, first: float | None, kind: str, prompt_ids: list[int] | None,
               output_ids: list[int] | None) -> dict[str, Any]:
        now = time.perf_counter()
        first = first or now
        ns = lambda s: int(s * 1e9)  # noqa: E731
        stats = {"done": True, "done_reason": "length" if finish_reason_of(meta) == "length" else "stop",
                 "total_duration": ns(now - arrived), "load_duration": 0,
                 "prompt_eval_count": meta["prompt_tokens"] - meta.get("cached_tokens", 0),
                 "prompt_eval_duration": ns(first - arrived), "eval_count": meta["completion_tokens"],
                 "eval_duration": ns(now - first)}
        if kind == "generate" and prompt_ids is not None:
            stats["context"] = list(prompt_ids) + list(output_ids or [])
        return stats

    # ------------------------------------------------------------ models

    def _details(self) -> dict[str, Any]:
        info = self.api.engine.model_info
        path = Path(str(info.get("model_path", "")))
        arch = str(info.get("architecture") or "")
        return {"parent_model": "", "format": "gguf" if path.suffix == ".gguf" else "safetensors", "family": arch,
                "families": [arch] if arch else None, "parameter_size": "", "quantization_level": ""}

    def _card(self, name: str, path: str) -> dict[str, Any]:
        p = Path(path)
        files = [p] if p.is_file() else [f for f in p.glob("*") if f.is_file()] if p.is_dir() else []
        return {"name": name, "model": name, "modified_at": self.created, "size": sum(f.stat().st_size for f in files),
                "digest": hashlib.sha256(path.encode()).hexdigest(), "details": self._details()}

    def _cards(self) -> list[dict[str, Any]]:
        api = self.api
        return [self._card(api.model_name, api.model_path),
                *(self._card(n, p) for n, p in (api.engine.lora_adapters or {}).items())]

    def tags(self) -> dict[str, Any]:
        return {"models": self._cards()}

    def ps(self) -> dict[str, Any]:
        return {"models": [{**c, "expires_at": "9999-12-31T23:59:59Z", "size_vram": 0} for c in self._cards()]}

    def show(self, req: OllamaShow) -> dict[str, Any]:
        api, info = self.api, self.api.engine.model_info
        name = req.model or req.name
        if name is None:
            raise bad_request("model: required")
        adapters = api.engine.lora_adapters or {}
        if name != api.model_name and name not in adapters and api.strict_model_name:
            raise APIError(404, f"model '{name}' not found")
        arch = str(info.get("architecture") or "")
        caps = ["completion", "tools"] + (["thinking"] if api.chat_api.reasoning is not None else [])
        caps += ["vision"] if info.get("supports_images") else []
        return {"modelfile": "", "parameters": "", "template": info.get("chat_template") or "",
                "details": self._details(), "modified_at": self.created, "capabilities": caps,
                "model_info": {"general.architecture": arch, f"{arch}.context_length": api.context_length,
                               f"{arch}.vocab_size": api.vocab_size}}


def _fold(whole: dict[str, Any], line: dict[str, Any], kind: str) -> dict[str, Any]:
    """A non-streamed response: the lines of the stream as one object."""
    if not whole:
        return dict(line, **({"message": dict(line["message"])} if kind == "chat" else {}))
    out = {**whole, **{k: v for k, v in line.items() if k not in ("message", "response", "thinking")}}
    if kind == "chat":
        msg, new = out["message"], line["message"]
        msg["content"] += new["content"]
        if new.get("thinking"):
            msg["thinking"] = msg.get("thinking", "") + new["thinking"]
        if new.get("tool_calls"):
            msg["tool_calls"] = new["tool_calls"]
    else:
        out["response"] = whole["response"] + line["response"]
        if line.get("thinking"):
            out["thinking"] = whole.get("thinking", "") + line["thinking"]
    return out


def ollama_router(api: OpenAIServing, metrics: ServerMetrics) -> APIRouter:
    serving = OllamaServing(api)
    router = APIRouter()

    @router.post("/api/chat")
    async def chat(req: OllamaChat, request: Request):
        metrics.requests.inc(api="ollama_chat")
        return await serving.chat(req, request)

    @router.post("/api/generate")
    async def generate(req: OllamaGenerate, request: Request):
        metrics.requests.inc(api="ollama_generate")
        return await serving.generate(req, request)

    @router.get("/api/tags")
    async def tags():
        return JSONResponse(serving.tags())

    @router.get("/api/ps")
    async def ps():
        return JSONResponse(serving.ps())

    @router.post("/api/show")
    async def show(req: OllamaShow):
        return JSONResponse(serving.show(req))

    @router.get("/api/version")
    async def ollama_version():
        return JSONResponse({"version": version("radixgen")})

    return router
