"""The OpenAI-compatible API: /v1/models here, with what /v1/completions (openai_completions.py) and
/v1/chat/completions (openai_chat.py) share: request checks, tokenization, sampling parameters, jobs.

Each (prompt, choice) pair is one engine request with n=1 (choice j of a seeded request gets seed + j),
so streamed and non-streamed requests take the same path and give the same text."""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator
from contextlib import aclosing
from functools import lru_cache
from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from radixgen.runtime.sampling_params import choice_seeds
from radixgen.runtime.server.errors import APIError, bad_request
from radixgen.runtime.server.openai_stream import SSE_DONE, EventStream, Job, sse
from radixgen.runtime.server.protocol import NO_EFFECT, ChatCompletionRequest, CompletionRequest, SamplingFields
from radixgen.runtime.server.serving import Dispatcher, merge, new_rid, until_disconnect

__all__ = ["SSE_DONE", "EventStream", "Job", "OpenAIServing", "sse"]

logger = logging.getLogger("radixgen.server")


class OpenAIServing:
    def __init__(self, engine: Any, dispatcher: Dispatcher, served_model_name: str, strict_model_name: bool = False):
        from radixgen.runtime.server.openai_chat import ChatServing
        from radixgen.runtime.server.openai_completions import CompletionServing

        self.engine = engine
        self.dispatcher = dispatcher
        self.tokenizer = engine.tokenizer
        info = engine.model_info
        self.context_length = int(info["context_length"])
        self.vocab_size = int(info["vocab_size"])
        self.model_name = served_model_name
        self.strict_model_name = strict_model_name  # else any `model` is served by this model (as SGLang)
        self.model_path = str(info.get("model_path", ""))
        self.created = int(time.time())
        self.token_text = lru_cache(maxsize=65536)(self._token_text)
        self.completion_api = CompletionServing(self)
        self.chat_api = ChatServing(self)

    def _token_text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id])

    async def completions(self, req: CompletionRequest, request: Request) -> Response:
        return await self.completion_api.create(req, request)

    async def chat(self, req: ChatCompletionRequest, request: Request) -> Response:
        return await self.chat_api.create(req, request)

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
        if model_id != self.model_name:  # a lookup by name: only the served name exists
            raise APIError(404, f"The model `{model_id}` does not exist.", "model", "model_not_found")
        return self.model_card()

    # ------------------------------------------------------------ shared request building

    def admit(self, req: SamplingFields) -> None:
        """Checks every /v1 request passes first: the model name (when strict), and a debug note of the
        fields it sets that change nothing here."""
        if self.strict_model_name and req.model is not None and req.model != self.model_name:
            raise APIError(404, f"The model `{req.model}` does not exist.", "model", "model_not_found")
        ignored = req.no_effect_fields()
        if ignored and logger.isEnabledFor(logging.DEBUG):
            logger.debug("fields with no effect here: %s", {f: NO_EFFECT[f] for f in ignored})

    async def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`, on the Engine's tokenizer threads: a huge prompt must not stall the other
        streams. A text the tokenizer cannot take (a lone surrogate) is a RequestError (400)."""
        (ids,) = await self.engine.async_tokenize([text], add_special_tokens=add_special_tokens)
        return ids

    @staticmethod
    async def off_loop(param: str, fn: Any, *args: Any, **kwargs: Any) -> Any:
        """fn(*args, **kwargs) in a worker thread (rendering a long chat template is slow too); a
        TypeError / ValueError it raises is a 400 naming `param`."""
        try:
            return await asyncio.to_thread(fn, *args, **kwargs)
        except (TypeError, ValueError) as e:
            raise bad_request(f"{param}: {e}", param) from e

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
        for name in ("top_k", "min_p", "repetition_penalty", "stop_token_ids", "logit_bias"):
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
        seeds = choice_seeds(req.seed, n)  # distinct, reproducible samples per choice
        for p, ids in enumerate(prompts):
            for j in range(n):
                params = dict(sp[p])
                if req.seed is not None:
                    params["seed"] = seeds[j]
                k = p * n + j
                job_rid = rid if len(prompts) * n == 1 else f"{rid}-{k}"
                kwargs = {"input_ids": ids, "sampling_params": params, "cache_salt": req.cache_salt, **kw}
                out.append(Job(k, p, job_rid, kwargs))
        return out

    @staticmethod
    def request_id(req: SamplingFields, prefix: str) -> str:
        return req.rid or new_rid(prefix)

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
