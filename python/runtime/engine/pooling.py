"""The Engine's embed and score requests (runtime/pooling.py says what the model serves): prompts -> prefill-only
requests of kind embed / score -> the scheduler's pooled results -> vectors (truncated, normalised) and scores.

A decoder reranker (Qwen3-Reranker style) reads each (query, document) pair in one prompt that puts the
instruction and the query first, so the documents of one query share that prefix in the radix cache.
"""

from __future__ import annotations

import asyncio
import dataclasses
import threading
from typing import Any

from radixgen.runtime.engine.request_state import RequestError, RequestState
from radixgen.runtime.engine.validation import build_requests, check_unicode, prompt_ids, prompt_texts
from radixgen.runtime.messages import GenerateRequest
from radixgen.runtime.pooling import PoolingSpec, finish_vector, score_of

PREFILL_ONLY = {"max_new_tokens": 1, "temperature": 0.0}  # one logits row at the last prompt position
DEFAULT_INSTRUCTION = "Given a web search query, retrieve relevant passages that answer the query"
# the decoder reranker's prompt around (instruction, query, document): a yes/no judgement as the assistant's turn
RERANK_PREFIX = ("<|im_start|>system\nJudge whether the Document meets the requirements based on the Query and the "
                 "Instruct provided. Note that the answer can only be \"yes\" or \"no\".<|im_end|>\n<|im_start|>user\n")
RERANK_SUFFIX = "<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"


def check_kind(spec: PoolingSpec, kind: str) -> None:
    if kind not in spec.kinds():
        what = {"embed": "embeddings", "score": "scores (rerank)", "generate": "text generation"}[kind]
        raise RequestError(f"this model does not serve {what}; it serves: {', '.join(spec.kinds())}")


def check_dimensions(spec: PoolingSpec, dimensions: Any) -> int | None:
    if dimensions is None:
        return None
    if type(dimensions) is not int or dimensions < 1:
        raise RequestError(f"dimensions: must be a positive integer, got {dimensions!r}")
    if not spec.matryoshka:
        raise RequestError("dimensions: this model does not support Matryoshka truncation (its config declares "
                           "no is_matryoshka / matryoshka_dimensions)")
    if dimensions > spec.hidden_size:
        raise RequestError(f"dimensions: {dimensions} is more than the model's {spec.hidden_size}")
    return dimensions


class Pooling:
    """Builds and runs an Engine's embed and score requests (the Engine's `embed` / `score` delegate here)."""

    def __init__(self, engine) -> None:
        self.engine = engine
        self.spec: PoolingSpec = engine.pooling

    # ------------------------------------------------------------------ requests

    def _requests(self, kind: str, ids_list: list[list[int]], token_types: list | None, rid, cache_salt):
        eng = self.engine
        if eng.config.world_size > 1 and self.spec.encoder is None:
            raise RequestError("embed / score requests are not supported with tensor or pipeline parallelism")
        batched, base, reqs = build_requests(True, ids_list, PREFILL_ONLY, eng.limits, rid=rid,
                                             cache_salt=cache_salt)
        types = token_types or [None] * len(reqs)
        reqs = [dataclasses.replace(r, kind=kind, token_type_ids=t) for r, t in zip(reqs, types, strict=True)]
        states = [RequestState(r.rid, r.input_ids, r.params, eng.tokenizer, False, False) for r in reqs]
        return base, reqs, states

    def embed_requests(self, prompt, input_ids, dimensions, prompt_name, rid, cache_salt):
        check_kind(self.spec, "embed")
        dims = check_dimensions(self.spec, dimensions)
        if (prompt is None) == (input_ids is None):
            raise RequestError("exactly one of prompt and input_ids must be given")
        if prompt is not None:
            batched, texts = prompt_texts(prompt)
            if prompt_name is not None:
                if prompt_name not in self.spec.prompts:
                    raise RequestError(f"prompt_name: {prompt_name!r} is not one of the model's prompts "
                                       f"{sorted(self.spec.prompts)}")
                texts = [self.spec.prompts[prompt_name] + t for t in texts]
            ids = self.engine.tokenize(texts)
        else:
            batched, ids = prompt_ids(input_ids, self.engine.limits.vocab_size)
        return batched, dims, self._requests("embed", ids, None, rid, cache_salt)

    def score_requests(self, query, documents, instruction, rid, cache_salt):
        check_kind(self.spec, "score")
        if not isinstance(query, str) or not query:
            raise RequestError("query: must be a non-empty string")
        if instruction is not None and not isinstance(instruction, str):
            raise RequestError("instruction: must be a string")
        _, docs = prompt_texts(documents)
        check_unicode("query", query)
        tok = self.engine.tokenizer
        if self.spec.classifier:  # a cross-encoder reads the pair with its segment ids
            encs = [tok(query, d) for d in docs]
            ids = [list(e["input_ids"]) for e in encs]
            types = [list(e["token_type_ids"]) if "token_type_ids" in e else None for e in encs]
        else:
            head = f"{RERANK_PREFIX}<Instruct>: {instruction or DEFAULT_INSTRUCTION}\n<Query>: {query}\n<Document>: "
            ids = self.engine.tokenize([f"{head}{d}{RERANK_SUFFIX}" for d in docs], add_special_tokens=False)
            types = None
        return self._requests("score", ids, types, rid, cache_salt)

    # ------------------------------------------------------------------ results

    def vectors(self, states: list[RequestState], dims: int | None) -> list[dict]:
        out = []
        for st in states:
            st.raise_for_failure()
            if st.pooled is None:
                raise RequestError(st.finish_reason.message if st.finish_reason else "no embedding was computed")
            out.append({"embedding": finish_vector(st.pooled, self.spec.normalize, dims),
                        "prompt_tokens": st.prompt_tokens, "cached_tokens": st.cached_tokens})
        return out

    @staticmethod
    def scores(states: list[RequestState]) -> list[dict]:
        out = []
        for i, st in enumerate(states):
            st.raise_for_failure()
            if st.pooled is None:
                raise RequestError(st.finish_reason.message if st.finish_reason else "no score was computed")
            out.append({"index": i, "score": score_of(st.pooled), "prompt_tokens": st.prompt_tokens,
                        "cached_tokens": st.cached_tokens})
        return out

    # ------------------------------------------------------------------ the Engine's calls

    def embed(self, prompt=None, input_ids=None, dimensions=None, prompt_name=None, rid=None, cache_salt=None):
        batched, dims, (base, reqs, states) = self.embed_requests(prompt, input_ids, dimensions, prompt_name, rid,
                                                                  cache_salt)
        self.run(base, reqs, states)
        out = self.vectors(states, dims)
        return out if batched else out[0]

    async def aembed(self, prompt=None, input_ids=None, dimensions=None, prompt_name=None, rid=None,
                     cache_salt=None):
        loop = asyncio.get_running_loop()
        batched, dims, (base, reqs, states) = await loop.run_in_executor(
            self.engine._tokenize_pool, self.embed_requests, prompt, input_ids, dimensions, prompt_name, rid,
            cache_salt)
        await self.arun(base, reqs, states)
        out = self.vectors(states, dims)
        return out if batched else out[0]

    def score(self, query, documents, instruction=None, rid=None, cache_salt=None) -> list[dict]:
        base, reqs, states = self.score_requests(query, documents, instruction, rid, cache_salt)
        self.run(base, reqs, states)
        return self.scores(states)

    async def ascore(self, query, documents, instruction=None, rid=None, cache_salt=None) -> list[dict]:
        loop = asyncio.get_running_loop()
        base, reqs, states = await loop.run_in_executor(self.engine._tokenize_pool, self.score_requests, query,
                                                        documents, instruction, rid, cache_salt)
        await self.arun(base, reqs, states)
        return self.scores(states)

    # ------------------------------------------------------------------ running

    def run(self, base: str, reqs: list[GenerateRequest], states: list[RequestState]) -> None:
        client = self.engine._client
        events = []
        for st in states:
            ev = threading.Event()
            st.notify = ev.set
            events.append(ev)
        client.submit(base, reqs, states)
        try:
            for ev, st in zip(events, states, strict=True):
                while not st.finished:
                    ev.wait(0.5)
                    ev.clear()
                    if client.fatal is not None and not st.finished:
                        raise RuntimeError(client.fatal)
        finally:
            client.end_group(base)

    async def arun(self, base: str, reqs: list[GenerateRequest], states: list[RequestState]) -> None:
        await self.engine._client.run_group(base, reqs, states)
