"""EngineBackend: programs run against an in-process `Engine`."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from typing import Any

from radixgen.lang.backend_base import BaseBackend, GenRequest


def engine_kwargs(requests: list[GenRequest]) -> dict[str, Any]:
    """Engine.generate arguments for requests that share a group key (see GenRequest.group_key)."""
    first = requests[0]
    kwargs: dict[str, Any] = {
        "sampling_params": [r.sampling_params for r in requests],
        "return_logprob": first.return_logprob,
        "logprob_start_len": first.logprob_start_len,
        "top_logprobs_num": first.top_logprobs_num,
        "return_text_in_logprobs": first.return_text_in_logprobs,
    }
    if first.lora_name is not None:
        kwargs["lora_name"] = first.lora_name
    if first.text is None:
        kwargs["input_ids"] = [r.input_ids for r in requests]
    else:
        kwargs["prompt"] = [r.text for r in requests]
    if any(r.images for r in requests):  # one entry per prompt (Engine.generate's image_data)
        kwargs["image_data"] = [list(r.images) or None for r in requests]
    return kwargs


def single_kwargs(request: GenRequest) -> dict[str, Any]:
    kwargs = engine_kwargs([request])
    kwargs["sampling_params"] = request.sampling_params
    for key in ("input_ids" if request.text is None else "prompt", "image_data"):
        if key in kwargs:
            kwargs[key] = kwargs[key][0]
    return kwargs


class EngineBackend(BaseBackend):
    def __init__(self, engine: Any, owns_engine: bool = False):
        self.engine = engine
        self.owns_engine = owns_engine

    @classmethod
    def start(cls, model_path: str | None = None, **config: Any) -> EngineBackend:
        """A backend over an Engine of its own, shut down with the backend: the one place where the language
        reaches into the runtime (everything else goes through the backend interface)."""
        from radixgen.runtime.engine import Engine

        return cls(Engine(model_path, **config), owns_engine=True)

    def get_tokenizer(self) -> Any:
        return self.engine.tokenizer

    @property
    def model_info(self) -> dict[str, Any]:
        return self.engine.model_info

    def tokenize(self, texts: list[str], add_special_tokens: bool = True) -> list[list[int]]:
        tokenizer = self.engine.tokenizer
        return [tokenizer(t, add_special_tokens=add_special_tokens).input_ids for t in texts]

    def special_token(self, which: str) -> str | None:
        return getattr(self.engine.tokenizer, f"{which}_token", None)

    def _generate_group(self, requests: list[GenRequest]) -> list[dict]:
        return self.engine.generate(**engine_kwargs(requests))

    async def _agenerate_group(self, requests: list[GenRequest]) -> list[dict]:
        return await self.engine.async_generate(**engine_kwargs(requests))

    def generate_stream(self, request: GenRequest) -> Iterator[dict]:
        return self.engine.generate(stream=True, **single_kwargs(request))

    async def agenerate_stream(self, request: GenRequest) -> AsyncIterator[dict]:
        chunks = await self.engine.async_generate(stream=True, **single_kwargs(request))
        async for chunk in chunks:
            yield chunk

    def embed(self, text: str, dimensions: int | None = None) -> dict[str, Any]:
        return self.engine.embed(text, dimensions=dimensions)

    async def aembed(self, text: str, dimensions: int | None = None) -> dict[str, Any]:
        return await self.engine.async_embed(text, dimensions=dimensions)

    def flush_cache(self) -> bool:
        return self.engine.flush_cache()

    def get_server_info(self) -> dict[str, Any]:
        return self.engine.get_server_info()

    def shutdown(self) -> None:
        """Shut the engine down if this backend created it (`radixgen.Runtime`)."""
        if self.owns_engine:
            self.engine.shutdown()

    def __enter__(self) -> EngineBackend:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.shutdown()
