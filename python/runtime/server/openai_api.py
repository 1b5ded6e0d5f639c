"""The OpenAI-compatible API: /v1/models here, with what /v1/completions (openai_completions.py),
/v1/chat/completions (openai_chat.py) and /v1/responses (openai_responses.py, on the chat path) share:
request checks, tokenization, sampling parameters, jobs.

Each (prompt, choice) pair is one engine request with n=1 (choice j of a seeded request gets seed + j),
so streamed and non-streamed requests take the same path and give the same text."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from contextlib import aclosing
from functools import lru_cache
from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from radixgen.common.constraint import TooManyConstraints, normalize_constraint
from radixgen.common.http_errors import APIError, bad_request
from radixgen.common.sampling_params import CONSTRAINT_FIELDS, choice_seeds, sampling_fields
from radixgen.runtime.server.openai_stream import SSE_DONE, EventStream, Job, sse
from radixgen.runtime.server.protocol import (
    NO_EFFECT,
    OPENAI_NAMES,
    OPENAI_NOT_EXPOSED,
    SET_BY_CHAT,
    ChatCompletionRequest,
    CompletionRequest,
    SamplingFields,
)
from radixgen.runtime.server.serving import Dispatcher, merge, new_rid, until_disconnect

__all__ = ["OPENAI_NAMES", "OPENAI_NOT_EXPOSED", "SET_BY_CHAT", "SSE_DONE", "EventStream", "Job", "OpenAIServing",
           "sse"]

logger = logging.getLogger("radixgen.server")

# Declared parameters the mapping sets itself: the token budget (max_tokens / max_completion_tokens against the
# context), n and seed (one job per choice, choice k seeded with seed + k), the constraint (constraint()), the
# thinking budget (the chat path's, SET_BY_CHAT). The body's fields: protocol.py (OPENAI_NAMES,
# OPENAI_NOT_EXPOSED).
SET_ELSEWHERE = frozenset(("max_new_tokens", "n", "seed", *CONSTRAINT_FIELDS, *SET_BY_CHAT))


class OpenAIServing:
    def __init__(self, engine: Any, dispatcher: Dispatcher, served_model_name: str, strict_model_name: bool = False,
                 reasoning_parser: str | None = None, tool_call_parser: str | None = None):
        from radixgen.runtime.server.openai_chat import ChatServing
        from radixgen.runtime.server.openai_completions import CompletionServing
        from radixgen.runtime.server.openai_responses import ResponsesServing

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
        self.chat_api = ChatServing(self, reasoning_parser, tool_call_parser)
        self.responses_api = ResponsesServing(self)  # /v1/responses, on chat_api

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

    def adapter_card(self, name: str, path: str) -> dict:
        """A LoRA adapter served over the base model: its id is the `model` that selects it."""
        return {**self.model_card(), "id": name, "root": path, "parent": self.model_name}

    def list_models(self) -> dict:
        adapters = self.engine.lora_adapters or {}
        return {"object": "list", "data": [self.model_card(), *(self.adapter_card(n, p) for n, p in adapters.items())]}

    def retrieve_model(self, model_id: str) -> dict:
        adapters = self.engine.lora_adapters or {}
        if model_id in adapters:
            return self.adapter_card(model_id, adapters[model_id])
        if model_id != self.model_name:  # a lookup by name: only the served name and the adapters exist
            raise APIError(404, f"The model `{model_id}` does not exist.", "model", "model_not_found")
        return self.model_card()

    # ------------------------------------------------------------ shared request building

    def admit(self, req: SamplingFields) -> str | list[str | None] | None:
        """Checks every /v1 request passes first: the model name, and a debug note of the fields it sets that
        change nothing here. Returns the request's LoRA adapter(s) (None: the base model; see lora_of)."""
        lora = self.lora_of(req)
        ignored = req.no_effect_fields()
        if ignored and logger.isEnabledFor(logging.DEBUG):
            logger.debug("fields with no effect here: %s", {f: NO_EFFECT[f] for f in ignored})
        return lora

    def lora_of(self, req: SamplingFields) -> str | list[str | None] | None:
        """The adapter a request runs on: `model` naming a loaded LoRA adapter (or SGLang's "base:adapter"), or
        the `lora_name` extra field (SGLang's `lora_path`, its alias). With LoRA enabled, any other model than the
        served one is a 404 (it would otherwise run silently on the base model); without, only when the names are
        strict."""
        adapters = self.engine.lora_adapters
        model, chosen = req.model, None
        if model is not None and model != self.model_name:
            base, sep, name = model.partition(":")
            if adapters is not None and model in adapters:
                chosen = model
            elif adapters is not None and sep and base == self.model_name and name in adapters:
                chosen = name
            elif adapters is not None or self.strict_model_name:
                known = ", ".join([self.model_name, *adapters]) if adapters else self.model_name
                raise APIError(404, f"The model `{model}` does not exist (served: {known}).", "model",
                               "model_not_found")
        key, named = req.lora
        if named is not None:
            if chosen is not None and named != chosen:
                raise bad_request(f"{key}: {named!r} differs from the adapter the model names ({chosen!r})", key)
            return named
        return chosen

    def response_model(self, req: SamplingFields) -> str:
        """The `model` of a response: the adapter the request runs on, else the served model."""
        lora = self.lora_of(req)
        return lora if isinstance(lora, str) else self.model_name

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
        """The native sampling dict of a request: every declared parameter the OpenAI body exposes (under its
        OPENAI_NAMES spelling), the token budget, and the request's one constraint."""
        sp: dict[str, Any] = {"max_new_tokens": max_new_tokens}
        for f in sampling_fields():
            if f.name not in SET_ELSEWHERE and f.name not in OPENAI_NOT_EXPOSED:
                value = getattr(req, OPENAI_NAMES.get(f.name, f.name))
                if value is not None:
                    sp[f.name] = value
        sp.update(constraint)
        return sp

    @staticmethod
    def constraint(req: SamplingFields, **more: dict | str | None) -> dict[str, str]:
        """The one output constraint of a request; 400 when several are given."""
        given = {"regex": req.regex, "json_schema": req.json_schema, "ebnf": req.ebnf, **more}
        try:  # response_format, tools: schemas
            constraint = normalize_constraint(given, kinds=dict.fromkeys(more, "json_schema"))
        except TooManyConstraints as e:
            names = sorted(e.given)
            raise bad_request(f"at most one output constraint may be given; got {names}", names[1]) from None
        return {} if constraint is None else {constraint.kind: constraint.text}

    def jobs(
        self, prompts: list, req: SamplingFields, sp: list[dict], rid: str,
        lora: str | list[str | None] | None = None, **kw
    ) -> list[Job]:
        """One engine request per (prompt, choice); `lora`: the adapter (admit's answer), or one per prompt."""
        if isinstance(lora, list) and len(lora) != len(prompts):
            raise bad_request(f"{req.lora[0]}: got {len(lora)} for {len(prompts)} prompts", req.lora[0])
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
                prompt = {"input_ids": ids} if isinstance(ids, list) else {"prompt": ids}  # a Prompt with images
                kwargs = {**prompt, "sampling_params": params, "cache_salt": req.cache_salt,
                          req.lora[0]: lora[p] if isinstance(lora, list) else lora, **kw}
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
