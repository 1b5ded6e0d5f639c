"""`radixgen.LLM`: the offline batch API in vLLM's shape, over an in-process `Engine`.

    from radixgen.offline import LLM, SamplingParams     # was: from vllm import LLM, SamplingParams
    llm = LLM()                                           # the bundled SmolLM2-135M-Instruct
    outs = llm.generate(["The capital of France is"], SamplingParams(temperature=0, max_tokens=8))
    print(outs[0].outputs[0].text)

Every prompt of a call is sent at once (the scheduler batches them and shares their prefixes
through the radix cache); results come back in prompt order. Requests run on the Engine's asyncio
API in a private event-loop thread, so `generate` works from any thread, a notebook included.
"""

from __future__ import annotations

import asyncio
import itertools
import threading
import uuid
from collections.abc import Sequence
from typing import Any

from radixgen.common.chat_render import content_text, render_chat
from radixgen.common.prompt import Prompt
from radixgen.offline.lora import LoRARegistry
from radixgen.offline.outputs import RequestOutput, request_output
from radixgen.offline.params import SamplingParams

# vLLM engine arguments with a radixgen equivalent (name -> Engine option); the rest go to the Engine as they are.
_RENAMED = {
    "max_model_len": "context_length",
    "max_num_seqs": "max_running_requests",
    "max_num_batched_tokens": "max_prefill_tokens",
    "tensor_parallel_size": "tp_size",
    "pipeline_parallel_size": "pp_size",
}


def engine_options(options: dict[str, Any]) -> dict[str, Any]:
    out = {}
    for name, value in options.items():
        if name == "enforce_eager":
            out["disable_cuda_graph"] = bool(value)
        elif name == "enable_prefix_caching":
            out["disable_radix_cache"] = not value
        elif name == "trust_remote_code":
            pass  # radixgen never runs a checkpoint's own code: its models are in radixgen.runtime.models
        elif name == "speculative_config":
            out.update(speculative_options(value))
        else:
            out[_RENAMED.get(name, name)] = value
    return out


def speculative_options(spec: Any) -> dict[str, Any]:
    """vLLM's speculative_config ({"method": "ngram" | "draft_model", "model": ..., "num_speculative_tokens":
    ...}; a "model" alone means a draft model) as Engine options."""
    if not isinstance(spec, dict):
        raise ValueError(f"LLM.speculative_config: must be a dict (got {type(spec).__name__})")
    unknown = sorted(set(spec) - {"method", "model", "num_speculative_tokens"})
    if unknown:
        raise ValueError(f"LLM.speculative_config: radixgen does not implement {unknown} (it takes method, model "
                         "and num_speculative_tokens)")
    method = spec.get("method") or ("draft_model" if spec.get("model") else None)
    if method is None:
        raise ValueError("LLM.speculative_config: give a method (ngram, draft_model) or a draft model")
    out = {"speculative_algorithm": method}
    if spec.get("model") is not None:
        out["speculative_draft_model"] = spec["model"]
    if "num_speculative_tokens" in spec:
        out["num_speculative_tokens"] = spec["num_speculative_tokens"]
    return out


class LLM:
    def __init__(self, model: str | None = None, *, tokenizer: str | None = None, seed: int | None = None,
                 **options: Any):
        """`model`: a model folder, GGUF file or hub name known locally (None: the bundled default);
        `options`: Engine options (RuntimeConfig fields) or their vLLM names (max_model_len...).
        `seed`: requests without a seed of their own get seed, seed+1, ... in the order they are sent."""
        from radixgen.runtime.engine import Engine

        if tokenizer is not None and tokenizer != model:
            raise ValueError("LLM.tokenizer: radixgen uses the model's own tokenizer (pass only model=...)")
        if seed is not None and (not isinstance(seed, int) or isinstance(seed, bool)):
            raise ValueError(f"LLM.seed: must be an integer (got {seed!r})")
        self.engine = Engine(model, **engine_options(options))
        self._loras = LoRARegistry(self.engine)
        self._seeds = None if seed is None else itertools.count(seed)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._lock = threading.Lock()

    def get_tokenizer(self) -> Any:
        return self.engine.tokenizer

    # ---- the API
    def generate(
        self,
        prompts: Any = None,
        sampling_params: Any = None,
        *,
        prompt_token_ids: list[list[int]] | list[int] | None = None,
        use_tqdm: bool = True,
        lora_request: Any = None,
    ) -> list[RequestOutput]:
        """One RequestOutput per prompt, in order. `prompts`: a string, a list of strings, a
        `{"prompt": str}` / `{"prompt_token_ids": [...]}` dict or a list of them (or token ids through
        `prompt_token_ids`). `sampling_params`: one for all prompts or a list with one per prompt; each
        a radixgen.offline.SamplingParams, the runtime's radixgen.SamplingParams or a dict of its fields
        (None: SamplingParams()). `lora_request`: a LoRARequest for all prompts or a list with one per prompt
        (None entries: the base model)."""
        items = self._prompts(prompts, prompt_token_ids)
        loras = self._loras.names(lora_request, len(items))
        return self._run(items, self._params(sampling_params, len(items)), use_tqdm, loras)

    def chat(
        self,
        messages: list[dict] | list[list[dict]],
        sampling_params: Any = None,
        *,
        use_tqdm: bool = True,
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        tools: list[dict] | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
        lora_request: Any = None,
    ) -> list[RequestOutput]:
        """Generate the next assistant turn of one conversation (a list of messages) or of each of a
        list of conversations, rendered with the model's chat template (or `chat_template`)."""
        if not isinstance(messages, (list, tuple)) or not messages:
            raise ValueError("LLM.chat: messages must be a non-empty list of messages (or of conversations)")
        conversations = [messages] if isinstance(messages[0], dict) else list(messages)
        tok = self.engine.tokenizer
        items = []
        for c, conv in enumerate(conversations):
            if not isinstance(conv, (list, tuple)) or not all(isinstance(m, dict) for m in conv):
                raise ValueError("LLM.chat: a conversation is a list of {'role': ..., 'content': ...} dicts")
            images: list = []
            flat = []
            for i, m in enumerate(conv):  # image parts -> the model's placeholder (common.chat_render)
                if isinstance(m.get("content"), list):
                    text, found = content_text(m["content"], self.engine.model_info.get("image_token"),
                                               f"LLM.chat: conversation {c} message {i} content")
                    m, images = {**m, "content": text}, images + found
                flat.append(m)
            text = render_chat(tok, flat, add_generation_prompt=add_generation_prompt,
                               continue_final_message=continue_final_message, tools=tools,
                               chat_template=chat_template, **(chat_template_kwargs or {}))
            # the template already holds any special tokens the model wants
            items.append(self._with_images(text, images, False) if images else
                         (text, tok(text, add_special_tokens=False).input_ids))
        loras = self._loras.names(lora_request, len(items))
        return self._run(items, self._params(sampling_params, len(items)), use_tqdm, loras)

    def shutdown(self) -> None:
        with self._lock:
            loop, self._loop = self._loop, None
        if loop is not None:
            loop.call_soon_threadsafe(loop.stop)
        self.engine.shutdown()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.shutdown()

    # ---- inputs
    def _prompts(self, prompts: Any, token_ids: Any) -> list[tuple]:
        if (prompts is None) == (token_ids is None):
            raise ValueError("LLM.generate: pass prompts or prompt_token_ids (one of them)")
        if token_ids is not None:
            batch = token_ids if token_ids and isinstance(token_ids[0], (list, tuple)) else [token_ids]
            return [(None, list(ids)) for ids in batch]
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        elif isinstance(prompts, Sequence) and prompts and isinstance(prompts[0], int):
            prompts = [{"prompt_token_ids": list(prompts)}]
        if not isinstance(prompts, Sequence) or not prompts:
            raise ValueError("LLM.generate: prompts must be a string, a dict or a non-empty list of them")
        tok = self.engine.tokenizer
        items = []
        for p in prompts:
            if isinstance(p, str):
                items.append((p, tok(p).input_ids))  # tokenized as Engine.generate tokenizes a text prompt
            elif isinstance(p, dict):
                extra = sorted(set(p) - {"prompt", "prompt_token_ids", "multi_modal_data"})
                if extra:
                    raise ValueError(f"LLM.generate: prompt field(s) {extra} are not supported")
                if p.get("multi_modal_data") is not None:
                    items.append(self._multimodal(p))
                elif "prompt_token_ids" in p:
                    items.append((p.get("prompt"), list(p["prompt_token_ids"])))
                elif "prompt" in p:
                    items.append((p["prompt"], tok(p["prompt"]).input_ids))
                else:
                    raise ValueError("LLM.generate: a prompt dict needs 'prompt' or 'prompt_token_ids'")
            elif isinstance(p, (list, tuple)):
                items.append((None, list(p)))
            else:
                raise ValueError(f"LLM.generate: a prompt is a string, a dict or token ids, not {type(p).__name__}")
        return items

    def _multimodal(self, p: dict) -> tuple[str, list[int], Prompt]:
        """A {"prompt": text, "multi_modal_data": {"image": an image or a list}} prompt (vLLM's form)."""
        data = p["multi_modal_data"]
        if not isinstance(data, dict) or set(data) - {"image"}:
            raise ValueError(f"LLM.generate: multi_modal_data takes {{'image': ...}}, got "
                             f"{sorted(data) if isinstance(data, dict) else type(data).__name__}")
        if not isinstance(p.get("prompt"), str):
            raise ValueError("LLM.generate: multi_modal_data goes with a text 'prompt'")
        images = data.get("image")
        return self._with_images(p["prompt"], list(images) if isinstance(images, (list, tuple)) else [images], True)

    def _with_images(self, text: str, images: list, special: bool) -> tuple[str, list[int], Prompt]:
        """(text, ids, the Prompt the Engine takes): the images decoded and processed here (engine/media_input)."""
        prompt, ids = self.engine.media.tokenized_prompt(text, images, self.engine.tokenize, "prompt", special)
        return text, ids, prompt

    @staticmethod
    def _params(sampling_params: Any, count: int) -> list[Any]:
        if sampling_params is None:
            return [SamplingParams()] * count
        if isinstance(sampling_params, (list, tuple)):
            if len(sampling_params) != count:
                raise ValueError(f"LLM.generate: {len(sampling_params)} sampling_params for {count} prompts")
            return list(sampling_params)
        return [sampling_params] * count

    def _request(self, ids: list[int], params: Any, prompt: Prompt | None = None) -> tuple[list[int], dict[str, Any]]:
        """(prompt ids, Engine.async_generate keyword arguments) of one prompt (`prompt`: with its images)."""
        kwargs: dict[str, Any] = {}
        if isinstance(params, SamplingParams):
            if params.truncate_prompt_tokens is not None and prompt is not None:
                raise ValueError("LLM.generate: truncate_prompt_tokens does not apply to a prompt with images")
            if params.truncate_prompt_tokens is not None:
                ids = ids[len(ids) - params.truncate_prompt_tokens :] if params.truncate_prompt_tokens else []
            native = params.native(len(ids), self.engine.model_info["context_length"])
            if params.logprobs is not None or params.prompt_logprobs is not None:
                kwargs.update(return_logprob=True, top_logprobs_num=params.top_logprobs_num,
                              return_text_in_logprobs=True)
                if params.prompt_logprobs is not None:
                    kwargs["logprob_start_len"] = 0
        elif isinstance(params, dict):
            native = dict(params)
        elif hasattr(params, "to_dict"):  # the runtime's own SamplingParams
            native = params.to_dict()
        else:
            raise ValueError(f"LLM.generate: sampling_params must be a SamplingParams or a dict, not {params!r}")
        if self._seeds is not None and native.get("seed") is None:
            native["seed"] = next(self._seeds)
        given = {"input_ids": ids} if prompt is None else {"prompt": prompt}
        return ids, {**given, "sampling_params": native, **kwargs}

    # ---- running
    def _event_loop(self) -> asyncio.AbstractEventLoop:
        with self._lock:
            if self._loop is None:
                self._loop = asyncio.new_event_loop()
                threading.Thread(target=self._loop.run_forever, daemon=True, name="radixgen-llm").start()
            return self._loop

    def _run(self, items: list[tuple], params: list[Any], use_tqdm: bool,
             loras: list[str | None] | None = None) -> list[RequestOutput]:
        # an item: (text, ids) or, with images, (text, ids, the Prompt the Engine takes)
        requests = [self._request(it[1], p, it[2] if len(it) > 2 else None)
                    for it, p in zip(items, params, strict=True)]
        for (_, kwargs), lora in zip(requests, loras or [None] * len(requests), strict=True):
            kwargs["lora_name"] = lora
        eos = set(self.engine.model_info.get("eos_token_ids") or [])

        async def one(kwargs: dict[str, Any]) -> list[dict]:
            result = await self.engine.async_generate(**kwargs)
            return result if isinstance(result, list) else [result]

        loop = self._event_loop()
        futures = [asyncio.run_coroutine_threadsafe(one(kwargs), loop) for _, kwargs in requests]
        bar = None
        if use_tqdm:
            from tqdm.auto import tqdm

            bar = tqdm(total=len(futures), desc="Processed prompts")
            for f in futures:
                f.add_done_callback(lambda _: bar.update(1))
        try:
            results = [f.result() for f in futures]
        except BaseException:
            for f in futures:  # a request that failed (or an interrupt): the others are aborted, not left running
                f.cancel()
            raise
        finally:
            if bar is not None:
                bar.close()
        return [
            request_output(uuid.uuid4().hex, text, ids, res, p, eos)
            for (text, *_), (ids, _), res, p in zip(items, requests, results, params, strict=True)
        ]
