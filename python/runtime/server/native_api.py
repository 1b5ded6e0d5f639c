"""The native API, wire-compatible with SGLang's: /generate (one prompt, a batch, n > 1, streamed or not),
/tokenize and /detokenize, /load_lora_adapter and /unload_lora_adapter, and the small routes SGLang's clients
call (/server_info, /get_load, /flush_cache, /concate_and_append_request...). The request bodies are in
native_protocol.py.

Results have SGLang's shape: `{"text", "output_ids", "meta_info"}` for one prompt with n = 1, a flat list
(prompt-major, then the n samples) otherwise. Streams send `data:` chunks whose `text` and `output_ids`
are cumulative while the output-side logprob lists (`output_token_logprobs`, `output_top_logprobs`) carry
only the tokens new since the previous chunk (`output_token_logprobs_length` counts them all); the
chunks of a batch or of n > 1 carry their `index`."""

from __future__ import annotations

import asyncio
import re
import time
from collections.abc import AsyncIterator
from contextlib import aclosing
from typing import Any, NamedTuple

from fastapi import APIRouter, Query
from starlette.requests import Request
from starlette.responses import Response

from radixgen.common.chat_render import render_chat
from radixgen.common.http_errors import APIError, JSONResponse, bad_request, error_body, error_of
from radixgen.common.media import client_sources
from radixgen.common.sampling_params import choice_seeds
from radixgen.runtime.engine.request_state import RequestError
from radixgen.runtime.server.native_protocol import (
    ConcateAndAppendRequest,
    DetokenizeRequest,
    GenerateRequest,
    LoadLoRAAdapterRequest,
    NativeSamplingParams,
    TokenizeRequest,
    UnloadLoRAAdapterRequest,
    parse_sampling_params,
)
from radixgen.runtime.server.openai_api import SSE_DONE, EventStream, OpenAIServing, sse
from radixgen.runtime.server.serving import Dispatcher, merge, new_rid, until_disconnect

_OUTPUT_LISTS = ("output_token_logprobs", "output_top_logprobs")  # sent as per-chunk deltas when streamed


class _Item(NamedTuple):
    """One prompt of a /generate request with its own values of the per-prompt fields."""

    prompt: str | None
    ids: list[int] | None
    params: NativeSamplingParams
    rid: str  # the engine rid of this prompt (its samples get -0, -1... when n > 1)
    kwargs: dict[str, Any]  # engine arguments other than the prompt and the sampling parameters


def _pick(value: Any, i: int, default: Any) -> Any:
    v = value[i] if isinstance(value, list) else value
    return default if v is None else v


def _salt(cache_salt: str | None, extra_key: str | None) -> str | None:
    if cache_salt is None or extra_key is None:
        return cache_salt if extra_key is None else f"extra_key:{extra_key}"
    return f"{cache_salt}\x00extra_key:{extra_key}"


def special_tokens_pattern(tokenizer: Any) -> re.Pattern | None:
    """A regex that splits text at the tokenizer's special (added) tokens, keeping them; None if none."""
    added = sorted(getattr(tokenizer, "get_added_vocab", dict)(), key=len, reverse=True)
    return re.compile("(" + "|".join(map(re.escape, added)) + ")") if added else None


def space_special_tokens(pattern: re.Pattern | None, text: str) -> str:
    """spaces_between_special_tokens: the text's runs and its special tokens joined by one space, as Hugging
    Face's slow tokenizers decode. Text only grows and this keeps prefixes, so streamed deltas stay right."""
    if pattern is None:
        return text
    return " ".join(part for part in pattern.split(text) if part)


class NativeServing:
    def __init__(self, engine: Any, dispatcher: Dispatcher, openai: OpenAIServing):
        self.engine = engine
        self.dispatcher = dispatcher
        self.openai = openai  # shares the tokenizer helpers: token text cache, vocabulary checks
        self.tokenizer = engine.tokenizer
        self.context_length = engine.model_info["context_length"]
        self._special = special_tokens_pattern(self.tokenizer)

    def _spaced(self, params: NativeSamplingParams, text: str) -> str:
        if not params.spaces_between_special_tokens or params.skip_special_tokens is not False:
            return text
        return space_special_tokens(self._special, text)

    # ------------------------------------------------------------ /generate

    async def _items(self, req: GenerateRequest, base: str) -> list[_Item]:
        size = req.batch_size
        texts = None if req.text is None else (req.text if size is not None else [req.text])
        ids_list = None if req.input_ids is None else (req.input_ids if size is not None else [req.input_ids])
        count = size or 1
        if ids_list is not None:
            for ids in ids_list:
                self.openai.check_ids(ids, "input_ids")  # type: ignore[arg-type]
        params = []
        for i in range(count):
            where = f"sampling_params[{i}]" if isinstance(req.sampling_params, list) else "sampling_params"
            params.append(parse_sampling_params(_pick(req.sampling_params, i, None), where))
        needs_ids = req.return_prompt_token_ids or any(p.max_new_tokens is None for p in params)
        if req.image_data is not None and needs_ids:
            raise bad_request("image_data: max_new_tokens null and return_prompt_token_ids need the prompt's tokens "
                              "before its images are processed; give max_new_tokens", "image_data")
        if texts is not None and needs_ids:
            # the token count is needed here; off the event loop, as the engine would do it
            ids_list = await asyncio.to_thread(lambda: [self.tokenizer(t).input_ids for t in texts])
            texts = None
        items = []
        for i in range(count):
            if isinstance(req.rid, list):
                rid = req.rid[i]
            else:
                rid = base if size is None else f"{base}-{i}"
            kwargs = {
                "return_logprob": bool(_pick(req.return_logprob, i, False)),
                "logprob_start_len": _pick(req.logprob_start_len, i, -1),
                "top_logprobs_num": _pick(req.top_logprobs_num, i, 0),
                "return_text_in_logprobs": req.return_text_in_logprobs,
                "cache_salt": _salt(_pick(req.cache_salt, i, None), _pick(req.extra_key, i, None)),
                req.lora[0]: _pick(req.lora[1], i, None),  # lora_name, or lora_path as the client spelled it
                "image_data": client_sources(req.image_data if size is None else req.image_data[i] if req.image_data
                                             else None),  # a client's strings: no local file unless allowed
            }
            ids = None if ids_list is None else list(ids_list[i])
            items.append(_Item(None if texts is None else texts[i], ids, params[i], rid, kwargs))
        return items

    def _engine_params(self, item: _Item) -> dict[str, Any]:
        return item.params.to_engine(None if item.ids is None else len(item.ids), self.context_length)

    async def generate(self, req: GenerateRequest, request: Request) -> Response:
        arrived = time.perf_counter()
        base = req.rid if isinstance(req.rid, str) else new_rid()
        items = await self._items(req, base)
        if req.stream:
            return await self._open_stream(req, items, base, arrived)
        calls = self._calls(req, items, base)
        rids = [rid for rid, _ in calls]
        try:
            self.dispatcher.refuse_taken([base, *rids])
        except APIError:
            for _, coro in calls:
                coro.close()
            raise
        self.dispatcher.open_group(base, rids)
        try:
            outs = await until_disconnect(request, self._gather(calls, arrived))
        finally:
            self.dispatcher.groups.pop(base, None)
        results = [o for out in outs for o in (out if isinstance(out, list) else [out])]
        latency = time.perf_counter() - arrived
        owners = [i for i, it in enumerate(items) for _ in range(it.params.n or 1)]
        for out, i in zip(results, owners, strict=True):
            out["text"] = self._spaced(items[i].params, out["text"])
            self._finish_meta(out, items[i], latency, req.return_prompt_token_ids)
        if not req.is_batch and (items[0].params.n or 1) == 1:
            return JSONResponse(results[0])
        return JSONResponse(results)

    def _calls(self, req: GenerateRequest, items: list[_Item], base: str) -> list[tuple[str, Any]]:
        """(rid, coroutine) engine calls: one for a single prompt or a uniform batch, else one per prompt."""
        def same(kwargs: dict) -> dict:  # what must agree for one batched call (images go per prompt)
            return {k: v for k, v in kwargs.items() if k != "image_data"}

        uniform = not isinstance(req.rid, list) and all(same(it.kwargs) == same(items[0].kwargs) for it in items)
        if not req.is_batch or uniform:
            prompts = [it.prompt for it in items] if items[0].ids is None else None
            ids = None if prompts is not None else [it.ids for it in items]
            if not req.is_batch:
                prompts = None if prompts is None else prompts[0]
                ids = None if ids is None else ids[0]
            sp = [self._engine_params(it) for it in items] if req.is_batch else self._engine_params(items[0])
            kwargs = dict(items[0].kwargs)
            if req.is_batch and any(it.kwargs["image_data"] is not None for it in items):
                kwargs["image_data"] = [it.kwargs["image_data"] for it in items]
            coro = self.engine.async_generate(prompt=prompts, input_ids=ids, sampling_params=sp, rid=base, **kwargs)
            return [(base, coro)]
        return [(it.rid, self.engine.async_generate(prompt=it.prompt, input_ids=it.ids, rid=it.rid,
                                                    sampling_params=self._engine_params(it), **it.kwargs))
                for it in items]

    async def _gather(self, calls: list[tuple[str, Any]], arrived: float) -> list[Any]:
        tasks = [asyncio.ensure_future(self.dispatcher.call([rid], arrived, coro)) for rid, coro in calls]
        try:
            return await asyncio.gather(*tasks)
        finally:  # one failed (or the client left): the others are cancelled, which aborts them
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    @staticmethod
    def _finish_meta(out: dict, item: _Item, latency: float, with_ids: bool) -> None:
        meta = out["meta_info"]
        meta["e2e_latency"] = latency
        if "output_token_logprobs" in meta:
            meta["output_token_logprobs_length"] = len(meta["output_token_logprobs"])
        if with_ids:
            out["prompt_token_ids"] = item.ids

    # ------------------------------------------------------------ streams

    async def _open_stream(self, req: GenerateRequest, items: list[_Item], base: str, arrived: float):
        jobs: list[tuple[str, dict[str, Any]]] = []
        owners: list[int] = []
        for i, it in enumerate(items):
            n = it.params.n or 1
            sp = self._engine_params(it)
            seeds = choice_seeds(sp.get("seed"), n)  # as the engine seeds the samples of n > 1
            for k in range(n):
                p = {**sp, "n": 1}
                if seeds[k] is not None:
                    p["seed"] = seeds[k]
                rid = it.rid if n == 1 else f"{it.rid}-{k}"
                jobs.append((rid, {"prompt": it.prompt, "input_ids": it.ids, "sampling_params": p, **it.kwargs}))
                owners.append(i)
        streams = await self.dispatcher.open(jobs, arrived, prime=True)
        if len(jobs) == 1:
            cleanup = lambda: self.dispatcher.abort(jobs[0][0])
        else:
            self.dispatcher.open_group(base, [rid for rid, _ in jobs])
            cleanup = lambda: self.dispatcher.end_group(base)
        chunks = self._stream(streams, [items[i] for i in owners], arrived, indexed=len(jobs) > 1,
                              with_ids=req.return_prompt_token_ids)
        return EventStream(chunks, cleanup)

    async def _stream(self, streams: list[AsyncIterator[dict]], items: list[_Item], arrived: float,
                      indexed: bool, with_ids: bool) -> AsyncIterator[bytes]:
        sent_text = [0] * len(streams)
        sent_tokens = [0] * len(streams)
        sent_lists = [0] * len(streams)
        try:
            async with aclosing(merge(streams)) as chunks:  # type: ignore[type-var]
                async for index, chunk in chunks:
                    meta = dict(chunk["meta_info"])
                    done = meta.get("finish_reason") is not None
                    tokens = meta.get("completion_tokens", 0)
                    interval = items[index].params.stream_interval or 1
                    if not done and tokens - sent_tokens[index] < interval:
                        continue
                    text = self._spaced(items[index].params, chunk["text"])
                    out = {"text": text, "output_ids": chunk["output_ids"], "meta_info": meta,
                           "delta": text[sent_text[index]:]}
                    if "output_token_logprobs" in meta:
                        total = len(meta["output_token_logprobs"])
                        for key in _OUTPUT_LISTS:
                            if key in meta:
                                meta[key] = meta[key][sent_lists[index]:]
                        meta["output_token_logprobs_length"] = total
                        sent_lists[index] = total
                    if done:
                        meta["e2e_latency"] = time.perf_counter() - arrived
                    if with_ids:
                        out["prompt_token_ids"] = items[index].ids
                    if indexed:
                        out["index"] = index
                    sent_text[index], sent_tokens[index] = len(text), tokens
                    yield sse(out)
        except Exception as e:  # noqa: BLE001 - the status line is sent: report it in the stream
            yield sse(error_of(e).body())
        yield SSE_DONE

    # ------------------------------------------------------------ tokenizer endpoints

    def tokenize(self, req: TokenizeRequest) -> dict | list[dict]:
        if req.messages is not None:
            try:
                text = render_chat(self.tokenizer, req.messages)
            except Exception as e:  # noqa: BLE001 - jinja raises its own kinds
                raise bad_request(f"messages: the chat template could not be applied: {e}", "messages") from e
            ids = self.tokenizer.encode(text, add_special_tokens=False)
            return {"tokens": ids, "count": len(ids), "max_model_len": self.context_length}
        if req.prompt is not None:  # SGLang's shape: one object, lists for a list
            many = isinstance(req.prompt, list)
            seqs = [self.tokenizer.encode(t, add_special_tokens=req.add_special_tokens)
                    for t in (req.prompt if many else [req.prompt])]
            return {"tokens": seqs if many else seqs[0], "count": [len(s) for s in seqs] if many else len(seqs[0]),
                    "max_model_len": self.context_length}
        texts = req.text if isinstance(req.text, list) else [req.text]
        outs = []
        for t in texts:
            ids = self.tokenizer.encode(t, add_special_tokens=req.add_special_tokens)
            outs.append({"tokens": ids, "count": len(ids), "max_model_len": self.context_length})
        return outs if isinstance(req.text, list) else outs[0]

    def detokenize(self, req: DetokenizeRequest) -> dict:
        batch = bool(req.tokens) and isinstance(req.tokens[0], list)
        seqs = req.tokens if batch else [req.tokens]
        texts = []
        for ids in seqs:
            self.openai.check_ids(ids, "tokens")  # type: ignore[arg-type]
            texts.append(self.tokenizer.decode(ids, skip_special_tokens=req.skip_special_tokens))
        return {"text": texts if batch else texts[0]}


def native_router(native: NativeServing, server_info: Any) -> APIRouter:
    """The native routes. `server_info()` is the app's (awaitable) /server_info document."""
    engine, dispatcher = native.engine, native.dispatcher
    router = APIRouter()

    @router.post("/generate")
    async def generate(req: GenerateRequest, request: Request):
        dispatcher.metrics.requests.inc(api="generate")
        return await native.generate(req, request)

    @router.post("/tokenize")
    @router.post("/v1/tokenize")
    async def tokenize(req: TokenizeRequest):
        return JSONResponse(native.tokenize(req))

    @router.post("/detokenize")
    @router.post("/v1/detokenize")
    async def detokenize(req: DetokenizeRequest):
        return JSONResponse(native.detokenize(req))

    @router.get("/get_model_info")
    @router.get("/model_info")
    async def model_info():
        info = dict(engine.model_info)
        info.setdefault("tokenizer_path", info.get("model_path"))
        return JSONResponse(info)

    @router.get("/server_info")
    @router.get("/get_server_info")
    async def get_server_info():
        return JSONResponse(await server_info())

    @router.get("/get_load")
    async def get_load():
        info = await asyncio.to_thread(engine.get_server_info)
        cache = info.get("cache", {})
        return JSONResponse([{
            "dp_rank": 0,
            "num_reqs": info.get("num_running", 0) + info.get("num_waiting", 0),
            "num_running_reqs": info.get("num_running", 0),
            "num_waiting_reqs": info.get("num_waiting", 0),
            "num_tokens": cache.get("total", 0) - cache.get("free", 0) - cache.get("evictable", 0),
        }])

    @router.api_route("/flush_cache", methods=["GET", "POST"])
    async def flush_cache(timeout: float = Query(0.0, ge=0.0, le=600.0)):
        """Empty the radix cache; only while no request runs (with `timeout`, wait that long for it)."""
        deadline = time.monotonic() + timeout
        while not await asyncio.to_thread(engine.flush_cache):
            if time.monotonic() >= deadline:
                raise APIError(400, "the cache can only be flushed while no request is running", None, "busy")
            await asyncio.sleep(0.05)
        return JSONResponse({"success": True})

    async def lora_update(call, *args) -> JSONResponse:
        """SGLang's answer {success, error_message, loaded_adapters}; a failure is a 400 that also carries the
        OpenAI-shaped error."""
        try:
            adapters = await asyncio.to_thread(call, *args)
        except RequestError as e:
            body = {**error_body(400, str(e), "lora_name", "lora_adapter_error"), "success": False,
                    "error_message": str(e), "loaded_adapters": engine.lora_adapters or {}}
            return JSONResponse(body, status_code=400)
        return JSONResponse({"success": True, "error_message": None, "loaded_adapters": adapters})

    @router.post("/load_lora_adapter")
    async def load_lora_adapter(req: LoadLoRAAdapterRequest):
        return await lora_update(engine.load_lora_adapter, req.lora_name, req.lora_path, req.pinned)

    @router.post("/unload_lora_adapter")
    async def unload_lora_adapter(req: UnloadLoRAAdapterRequest):
        return await lora_update(engine.unload_lora_adapter, req.lora_name)

    @router.post("/concate_and_append_request")
    async def concate_and_append(req: ConcateAndAppendRequest):
        # SGLang's fork/join "concate_and_append": the client has already appended the branches' text to
        # the destination. radixgen re-encodes that text exactly on the next call, its shared prefix
        # coming from the radix cache, so there is nothing to move: say so, with success.
        return JSONResponse({"success": True, "src_rids": req.src_rids, "dst_rid": req.dst_rid,
                             "message": "the concatenated text is encoded on the next request "
                                        "(its shared prefix from the radix cache)"})

    return router
