"""The in-process API: tokenize, send requests to the scheduler process, detokenize results.

    with Engine() as eng:                      # the bundled SmolLM2-135M-Instruct
        out = eng.generate("Hello", {"max_new_tokens": 16, "temperature": 0})

The scheduler process, the zmq link and the receiver thread are `engine_client.SchedulerClient`; the checks made
before a request is sent are in `request_validation.py`; what the Engine knows of each request in flight
(its output, detokenized incrementally) is a `request_state.RequestState`. A bad request raises RequestError
(a ValueError) before anything is sent; a request that failed inside the runtime raises RequestFailed; a dead
scheduler raises RuntimeError.

Longer than 400 lines: the Engine is the public in-process API (generate, embed, score and their async forms, LoRA
and cache control), one class a user reads in one place; its machinery lives in the modules named above.
"""

from __future__ import annotations

import asyncio
import functools
import os
import queue
import threading
from collections.abc import AsyncIterator, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from radixgen.common.prompt import Prompt
from radixgen.runtime.config import RuntimeConfig
from radixgen.runtime.engine.client import SchedulerClient, call_soon
from radixgen.runtime.engine.media_fetch import RemoteFetcher
from radixgen.runtime.engine.media_input import MediaFrontEnd, salted
from radixgen.runtime.engine.pooling import Pooling, check_kind
from radixgen.runtime.engine.request_state import RequestError, RequestFailed, RequestState
from radixgen.runtime.engine.validation import (
    ModelLimits,
    Prepared,
    assemble_ids,
    build_requests,
    check_unicode,
    prompt_ids,
    prompt_texts,
    segment_texts,
    segmented_prompts,
)
from radixgen.runtime.loader import load_tokenizer, model_path_for, read_hf_config
from radixgen.runtime.messages import (
    GenerateRequest,
    LoadLoRAAdapter,
    LoRAUpdate,
    TreeSnapshot,
    TreeSnapshotRequest,
    UnloadLoRAAdapter,
)
from radixgen.runtime.pooling import PoolingSpec

__all__ = ["Engine", "RequestError", "RequestFailed"]

TOKENIZER_THREADS = 4  # the fast tokenizers release the GIL while encoding
LORA_UPDATE_TIMEOUT_S = 300.0  # reading an adapter; a pinned one may wait for a slot to drain
# the bounds of a radix tree snapshot (get_radix_tree): what a console can draw, and a reply that stays small
TREE_LIMITS = {"max_nodes": 500, "max_depth": 64, "preview_chars": 200}


class Engine:
    def __init__(self, model: str | os.PathLike | None = None, **config: Any) -> None:
        self.config = RuntimeConfig.from_kwargs(model=None if model is None else str(model), **config)
        self.model_path = model_path_for(self.config)
        self.tokenizer = load_tokenizer(self.model_path)
        self.pooling = PoolingSpec.read(self.model_path, self.tokenizer)  # the request kinds it serves
        self._client = SchedulerClient(self.config, str(self.model_path))
        ready = self._client.ready
        self.model_info = self._build_model_info(ready)
        self.limits = ModelLimits(ready.vocab_size, ready.context_length, ready.num_slots, ready.grammar,
                                  self.config.grammar_strict_json)
        # the LoRA adapters the scheduler serves (name -> path), kept as its load / unload replies say; None: LoRA
        # is not enabled
        self.lora_adapters: dict[str, str] | None = ready.lora_adapters
        self._tokenize_pool = ThreadPoolExecutor(TOKENIZER_THREADS, thread_name_prefix="radixgen-tokenize")
        self._pooling = Pooling(self)  # embed and score requests (engine/pooling.py)
        # images: decoded and processed here, by the model's processor (None for a text-only model)
        self.media = MediaFrontEnd.for_model(self.model_info["architecture"], read_hf_config(self.model_path),
                                             self.model_path, self.config)
        self.model_info["image_token"] = self.media.image_token
        self.model_info["supports_images"] = self.media.processor is not None
        # http(s) images: fetched on their own bounded pool, so that a slow host never holds the tokenizer threads
        self._fetcher = RemoteFetcher(self.config)

    def _build_model_info(self, ready) -> dict:
        from radixgen.runtime.config import ModelConfig
        from radixgen.runtime.loader import read_hf_config
        from radixgen.runtime.special_tokens import eos_token_ids

        spec = self.pooling
        mc = None if spec.encoder is not None else ModelConfig.from_hf(read_hf_config(self.model_path))
        self._model_config = mc  # None for an encoder (runtime/pooling.py reads its folder)
        return {
            "model_path": str(self.model_path),
            "model_name": self.config.model or "SmolLM2-135M-Instruct",
            "vocab_size": ready.vocab_size,
            "context_length": ready.context_length,
            "num_kv_slots": ready.num_slots,
            "dtype": ready.dtype,
            "chat_template": getattr(self.tokenizer, "chat_template", None),
            "eos_token_ids": list(eos_token_ids(mc.eos_token_ids, self.tokenizer)) if mc else [],
            "bos_token_id": mc.bos_token_id if mc else None,
            "architecture": mc.architecture if mc else spec.encoder,
            "max_running_requests": ready.max_running_requests,
            "supports_constraints": ready.grammar,
            "is_generation": spec.is_generation,
            "request_kinds": list(spec.kinds()),  # generate / embed / score (runtime/pooling.py)
        }

    # ------------------------------------------------------------------ lifecycle

    def shutdown(self) -> None:
        self._client.shutdown()
        self._tokenize_pool.shutdown(wait=False, cancel_futures=True)
        self._fetcher.shutdown()

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

    @property
    def is_alive(self) -> bool:
        return self._client.is_alive

    # ------------------------------------------------------------------ tokenizing

    def tokenize(self, texts: list[str], add_special_tokens: bool = True) -> list[list[int]]:
        """Token ids of each text. A text that is not valid Unicode (a lone surrogate) is a RequestError."""
        for t in texts:
            if not isinstance(t, str):
                raise RequestError(f"prompt: must be a string, got {type(t).__name__}")
            check_unicode("prompt", t)
        return [self.tokenizer(t, add_special_tokens=add_special_tokens).input_ids for t in texts]

    async def async_tokenize(self, texts: list[str], add_special_tokens: bool = True) -> list[list[int]]:
        """`tokenize` on the engine's tokenizer threads (`loop.run_in_executor`), so that an asyncio event loop
        (an HTTP server's) keeps serving other requests while a long prompt is tokenized. Same ids and same
        errors as `tokenize`; for HTTP handlers that tokenize text themselves (chat templates, /tokenize)."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._tokenize_pool, self.tokenize, texts, add_special_tokens)

    # ------------------------------------------------------------------ requests

    def _ids(self, prompt, input_ids) -> tuple[bool, list[list[int]] | None, list[str] | None]:
        """(batched, token ids, texts still to tokenize): exactly one of the last two is given."""
        if (prompt is None) == (input_ids is None):
            raise RequestError("exactly one of prompt and input_ids must be given")
        if prompt is not None:
            batched, texts = prompt_texts(prompt)
            return batched, None, texts
        batched, ids = prompt_ids(input_ids, self.limits.vocab_size)
        return batched, ids, None

    def _prepare(self, prompt, input_ids, sampling_params, image_data=None, **kw) -> Prepared:
        """Tokenize and process images (in the calling thread) and validate; nothing is sent."""
        check_kind(self.pooling, "generate")  # an embedding model or a reranker refuses generation
        if image_data is not None:
            if input_ids is not None:
                raise RequestError("image_data: goes with a text prompt, not input_ids")
            prompt = self.media.with_images(prompt, image_data)
        segmented = segmented_prompts(prompt) if input_ids is None else None
        if segmented is not None:
            batched, prompts = segmented
            media = salted(self.media.process(prompts, batched), kw.get("cache_salt"))
            first, rest = segment_texts(prompts)
            ids, kw["media"] = assemble_ids(prompts, self.tokenize(first),
                                            self.tokenize(rest, add_special_tokens=False), self.limits.vocab_size,
                                            media)
        else:
            batched, ids, texts = self._ids(prompt, input_ids)
            if texts is not None:
                ids = self.tokenize(texts)
        self.media.check_placeholders(ids, kw.get("media"), batched)
        return build_requests(batched, ids, sampling_params, self.limits, loras=self.lora_adapters, **kw)

    async def _aprepare(self, prompt, input_ids, sampling_params, image_data=None, **kw) -> Prepared:
        """As `_prepare`, on the engine's tokenizer threads (off the event loop): tokenizing and image decoding."""
        if self.media.processor is not None:  # a text-only model refuses images without fetching them
            prompt, image_data = await self._fetcher.resolve(prompt, image_data)
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(
            self._tokenize_pool, functools.partial(self._prepare, prompt, input_ids, sampling_params, image_data, **kw))

    async def media_prompt(self, text: str, images: list, where: str = "messages") -> tuple[Prompt, int]:
        """A rendered chat prompt with image placeholders and its images as a Prompt (tokens and processed images,
        prepared off the event loop) and its length in tokens; RequestError for a bad image (engine/media_input)."""
        if self.media.processor is not None:
            images = await self._fetcher.resolve_list(images)
        loop = asyncio.get_running_loop()
        prompt, ids = await loop.run_in_executor(self._tokenize_pool, self.media.tokenized_prompt, text, images,
                                                 self.tokenize, where)
        return prompt, len(ids)

    def _states(self, reqs: list[GenerateRequest], text_in_logprobs: bool) -> list[RequestState]:
        return [RequestState(r.rid, r.input_ids, r.params, self.tokenizer, r.return_logprob, text_in_logprobs)
                for r in reqs]

    def generate(self, prompt=None, sampling_params=None, input_ids=None, return_logprob: bool = False,
                 logprob_start_len: int = -1, top_logprobs_num: int = 0, stream: bool = False,
                 rid: str | None = None, cache_salt: str | None = None,
                 return_text_in_logprobs: bool = False, lora_name: str | list[str | None] | None = None,
                 image_data=None, lora_path: str | list[str | None] | None = None):
        """Generate for one prompt (a dict) or a list (a list of dicts); see the module docstring. `lora_name`:
        the name of a loaded LoRA adapter (or a list with one per prompt, None for the base model); `lora_path` is
        SGLang's name of it (an adapter's name here too, not a folder). `image_data`:
        an image or a list of images for a text prompt (a list with one entry per prompt for a list of prompts),
        each a path, bytes, base64, a data URL or a PIL image (engine/media_input.py); a prompt may also be a
        common.prompt.Prompt with media segments."""
        batched, base, reqs = self._prepare(prompt, input_ids, sampling_params, image_data,
                                            return_logprob=return_logprob,
                                            logprob_start_len=logprob_start_len,
                                            top_logprobs_num=top_logprobs_num, rid=rid, cache_salt=cache_salt,
                                            lora_name=lora_name, lora_path=lora_path)
        if stream:
            if batched:
                raise RequestError("stream=True takes a single prompt with n=1")
            return self._stream(base, reqs, return_text_in_logprobs)
        states = self._states(reqs, return_text_in_logprobs)
        events = []
        for st in states:
            ev = threading.Event()
            st.notify = ev.set
            events.append(ev)
        self._client.submit(base, reqs, states)
        try:
            for ev, st in zip(events, states, strict=True):
                while not st.finished:
                    ev.wait(0.5)
                    ev.clear()
                    if self._client.fatal is not None and not st.finished:
                        raise RuntimeError(self._client.fatal)
        finally:
            self._client.end_group(base)
        results = [self._final(st) for st in states]
        return results if batched else results[0]

    @staticmethod
    def _final(st: RequestState) -> dict:
        st.raise_for_failure()
        return st.result()

    def _stream(self, base, reqs, text_in_logprobs) -> Iterator[dict]:
        """Sends at once (a refused request raises here); the iterator yields the chunks."""
        (st,) = self._states(reqs, text_in_logprobs)
        q: queue.SimpleQueue = queue.SimpleQueue()
        st.notify = lambda: q.put(None)
        self._client.submit(base, reqs, [st])

        def chunks() -> Iterator[dict]:
            try:
                while True:
                    try:
                        q.get(timeout=0.5)
                    except queue.Empty:
                        if self._client.fatal is not None and not st.finished:
                            raise RuntimeError(self._client.fatal) from None
                        continue
                    if st.finished:
                        st.raise_for_failure()
                        yield st.result(delta=True)
                        return
                    chunk = st.result(delta=True)
                    if chunk["delta"] or chunk["meta_info"].get("input_token_logprobs"):
                        yield chunk
            finally:
                if not st.finished:
                    self.abort(st.rid)

        return chunks()

    async def async_generate(self, prompt=None, sampling_params=None, input_ids=None,
                             return_logprob: bool = False, logprob_start_len: int = -1,
                             top_logprobs_num: int = 0, stream: bool = False, rid: str | None = None,
                             cache_salt: str | None = None, return_text_in_logprobs: bool = False,
                             lora_name: str | list[str | None] | None = None, image_data=None,
                             lora_path: str | list[str | None] | None = None):
        """Like generate; with stream=True returns an async iterator of chunks. Prompts are tokenized and their
        images processed off the event loop (see `async_tokenize`)."""
        batched, base, reqs = await self._aprepare(prompt, input_ids, sampling_params, image_data,
                                                   return_logprob=return_logprob,
                                                   logprob_start_len=logprob_start_len,
                                                   top_logprobs_num=top_logprobs_num, rid=rid,
                                                   cache_salt=cache_salt, lora_name=lora_name,
                                                   lora_path=lora_path)
        loop = asyncio.get_running_loop()
        if stream:
            if batched:
                raise RequestError("stream=True takes a single prompt with n=1")
            # sent before the iterator is returned: a refused request (its rid in use) raises here, so a caller
            # never holds an iterator whose cleanup would abort someone else's request
            (st,) = self._states(reqs, return_text_in_logprobs)
            q: asyncio.Queue = asyncio.Queue()
            st.notify = lambda: call_soon(loop, q.put_nowait, None)
            self._client.submit(base, reqs, [st])
            return self._astream(st, q)
        states = self._states(reqs, return_text_in_logprobs)
        await self._client.run_group(base, reqs, states)
        results = [self._final(st) for st in states]
        return results if batched else results[0]

    async def _astream(self, st: RequestState, q: asyncio.Queue) -> AsyncIterator[dict]:
        try:
            while True:
                await q.get()
                if st.finished:
                    st.raise_for_failure()
                    yield st.result(delta=True)
                    return
                chunk = st.result(delta=True)
                if chunk["delta"]:
                    yield chunk
        finally:
            if not st.finished:
                self.abort(st.rid)

    # ------------------------------------------------------------------ embed and score (engine/pooling.py)

    def embed(self, prompt=None, input_ids=None, dimensions: int | None = None, prompt_name: str | None = None,
              rid: str | None = None, cache_salt: str | None = None):
        """The embedding of a text (or token ids): {"embedding", "prompt_tokens", "cached_tokens"}; a list of them
        for a list. `dimensions`: Matryoshka truncation (then renormalised); `prompt_name`: one of the model's
        sentence-transformers prompts, prepended. A model that does not embed: RequestError."""
        return self._pooling.embed(prompt, input_ids, dimensions, prompt_name, rid, cache_salt)

    async def async_embed(self, prompt=None, input_ids=None, dimensions: int | None = None,
                          prompt_name: str | None = None, rid: str | None = None, cache_salt: str | None = None):
        return await self._pooling.aembed(prompt, input_ids, dimensions, prompt_name, rid, cache_salt)

    def score(self, query: str, documents: list[str], instruction: str | None = None, rid: str | None = None,
              cache_salt: str | None = None) -> list[dict]:
        """A reranker's relevance of each document to `query`, in document order: {"index", "score" (in [0, 1]),
        "prompt_tokens", "cached_tokens"}. A model that does not score: RequestError."""
        return self._pooling.score(query, documents, instruction, rid, cache_salt)

    async def async_score(self, query: str, documents: list[str], instruction: str | None = None,
                          rid: str | None = None, cache_salt: str | None = None) -> list[dict]:
        return await self._pooling.ascore(query, documents, instruction, rid, cache_salt)

    # ------------------------------------------------------------------ control

    def abort(self, rid: str) -> None:
        """Abort a request (or every request created by one generate call with that rid)."""
        self._client.abort(rid)

    def flush_cache(self) -> bool:
        return bool(self._client.control("flush_cache"))

    # ------------------------------------------------------------------ LoRA adapters

    def load_lora_adapter(self, name: str, path: str, pinned: bool = False) -> dict[str, str]:
        """Serve the PEFT adapter folder `path` as `name` (read and checked in the scheduler, off its loop);
        returns the loaded adapters (name -> path). A bad adapter (unreadable, rank above max_lora_rank, modules
        the model or the pool lacks, a name in use...) is a RequestError naming the problem. `pinned`: never
        replaced in the pool."""
        return self._lora_update(lambda reply_id: LoadLoRAAdapter(reply_id, name, path, pinned), "load_lora_adapter")

    def unload_lora_adapter(self, name: str) -> dict[str, str]:
        """Stop serving adapter `name`: new requests naming it are refused, those in flight finish, then its pool
        slot and its cached prefixes are freed. Returns the loaded adapters; an unknown name is a RequestError."""
        return self._lora_update(lambda reply_id: UnloadLoRAAdapter(reply_id, name), "unload_lora_adapter")

    def _lora_update(self, make_message, what: str) -> dict[str, str]:
        update: LoRAUpdate = self._client.call(make_message, what, timeout=LORA_UPDATE_TIMEOUT_S)
        if self.lora_adapters is not None:
            self.lora_adapters = dict(update.adapters)
        if update.error is not None:
            raise RequestError(update.error)
        return dict(update.adapters)

    def get_radix_tree(self, max_nodes: int = 64, max_depth: int = 12, preview_chars: int = 48,
                       viewer: str | None = None) -> TreeSnapshot:
        """A bounded picture of the radix cache (scheduler/radix/snapshot.py): the `max_nodes` largest subtrees,
        at most `max_depth` edges deep, each edge with a `preview_chars` text preview. `viewer`: an API key's cache
        namespace, which then sees only its own namespaces (per-key isolation). Out-of-range bounds: RequestError;
        a snapshot that failed in the scheduler: RequestFailed."""
        for name, value in (("max_nodes", max_nodes), ("max_depth", max_depth), ("preview_chars", preview_chars)):
            if type(value) is not int or not 1 <= value <= TREE_LIMITS[name]:
                raise RequestError(f"{name} must be an integer in [1, {TREE_LIMITS[name]}], got {value!r}")
        snapshot = self._client.call(
            lambda reply_id: TreeSnapshotRequest(reply_id, max_nodes, max_depth, preview_chars, viewer), "radix_tree")
        if isinstance(snapshot, str):  # the scheduler's message: the snapshot failed there (and it goes on)
            raise RequestFailed(f"the radix tree snapshot failed: {snapshot}")
        return snapshot

    def get_server_info(self) -> dict:
        info = self._client.control("server_info")
        info["model_path"] = self.model_info["model_path"]
        c = self.config
        info["parallel"] = {"tp_size": c.tp_size, "pp_size": c.pp_size, "ep_size": c.ep_size, "nnodes": c.nnodes,
                            "rank_pids": self._client.rank_pids}  # this node's rank processes
        return info
