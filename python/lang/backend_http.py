"""RuntimeEndpoint: programs run against a radixgen server over its native HTTP API.

`/generate` takes and returns exactly what `Engine.generate` does; streams are SSE `data:` lines
ending with `data: [DONE]`. Tokenization (for `select`) goes through the server's `/tokenize`, so
no local copy of the model is needed.
"""

from __future__ import annotations

import asyncio
import functools
import json
import weakref
from collections.abc import AsyncIterator, Iterator
from typing import Any

from radixgen.lang.backend_base import BaseBackend, GenRequest
from radixgen.lang.backend_engine import engine_kwargs, single_kwargs


def request_body(kwargs: dict[str, Any]) -> dict[str, Any]:
    """Engine.generate keyword arguments -> the /generate JSON body."""
    body = dict(kwargs)
    if "prompt" in body:
        body["text"] = body.pop("prompt")
    if "lora_name" in body:  # SGLang's /generate names the adapter lora_path (ours takes both)
        body["lora_path"] = body.pop("lora_name")
    if body.get("image_data") is not None:  # images travel as data URLs (an http(s) URL as it is)
        from radixgen.common.media import to_data_url

        batch = isinstance(body["text"], list)
        per_prompt = body["image_data"] if batch else [body["image_data"]]
        urls = [None if imgs is None else [to_data_url(x) for x in imgs] for imgs in per_prompt]
        body["image_data"] = urls if batch else urls[0]
    return body


def raise_for_error(status: int, payload: Any) -> None:
    if status < 400:
        return
    message = payload
    if isinstance(payload, dict) and isinstance(payload.get("error"), dict):
        message = payload["error"].get("message", payload)
    if status in (400, 404, 422):
        raise ValueError(str(message))
    raise RuntimeError(f"the server answered HTTP {status}: {message}")


def parse_sse_line(line: str) -> dict | None:
    """A chunk dict, or None for lines that carry none (blank lines, comments, the end marker)."""
    if not line.startswith("data:"):
        return None
    data = line[len("data:") :].strip()
    if data == "[DONE]":
        return None
    chunk = json.loads(data)
    if "error" in chunk and "text" not in chunk:
        error = chunk["error"]
        message = error.get("message", error) if isinstance(error, dict) else error
        raise RuntimeError(f"the server failed during the stream: {message}")
    return chunk


class RuntimeEndpoint(BaseBackend):
    def __init__(self, base_url: str, api_key: str | None = None, verify: Any = None, timeout: float = 600.0):
        import httpx

        self.base_url = base_url.rstrip("/")
        self._headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._client_args: dict[str, Any] = {
            "base_url": self.base_url,
            "headers": self._headers,
            "timeout": timeout,
        }
        if verify is not None:
            self._client_args["verify"] = verify
        self._client = httpx.Client(**self._client_args)
        # An AsyncClient belongs to the loop it was first used on: one per loop.
        self._aclients: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self._special: dict[str, str | None] = {}

    def _aclient(self):
        import httpx

        loop = asyncio.get_running_loop()
        client = self._aclients.get(loop)
        if client is None:
            client = self._aclients[loop] = httpx.AsyncClient(**self._client_args)
        return client

    def _get(self, path: str) -> Any:
        r = self._client.get(path)
        raise_for_error(r.status_code, _json(r))
        return r.json()

    def _post(self, path: str, body: dict[str, Any]) -> Any:
        r = self._client.post(path, json=body)
        raise_for_error(r.status_code, _json(r))
        return r.json()

    @functools.cached_property
    def _model_info(self) -> dict[str, Any]:
        return self._get("/get_model_info")

    @property
    def model_info(self) -> dict[str, Any]:
        return self._model_info

    def tokenize(self, texts: list[str], add_special_tokens: bool = True) -> list[list[int]]:
        out = self._post("/tokenize", {"text": list(texts), "add_special_tokens": add_special_tokens})
        return [o["tokens"] for o in out]

    def special_token(self, which: str) -> str | None:
        if which not in self._special:
            info = self.model_info
            token_id = info.get("bos_token_id") if which == "bos" else (info.get("eos_token_ids") or [None])[0]
            text = None
            if token_id is not None:
                text = self._post("/detokenize", {"tokens": [token_id], "skip_special_tokens": False})["text"]
            self._special[which] = text
        return self._special[which]

    def _generate_group(self, requests: list[GenRequest]) -> list[dict]:
        return self._post("/generate", request_body(engine_kwargs(requests)))

    @staticmethod
    def _embedding(out: dict) -> dict[str, Any]:
        usage = out["usage"]
        return {"embedding": out["data"][0]["embedding"], "prompt_tokens": usage["prompt_tokens"],
                "cached_tokens": (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)}

    def embed(self, text: str, dimensions: int | None = None) -> dict[str, Any]:
        return self._embedding(self._post("/v1/embeddings", {"input": text, "dimensions": dimensions}))

    async def aembed(self, text: str, dimensions: int | None = None) -> dict[str, Any]:
        r = await self._aclient().post("/v1/embeddings", json={"input": text, "dimensions": dimensions})
        raise_for_error(r.status_code, _json(r))
        return self._embedding(r.json())

    async def _agenerate_group(self, requests: list[GenRequest]) -> list[dict]:
        r = await self._aclient().post("/generate", json=request_body(engine_kwargs(requests)))
        raise_for_error(r.status_code, _json(r))
        return r.json()

    def generate_stream(self, request: GenRequest) -> Iterator[dict]:
        body = {**request_body(single_kwargs(request)), "stream": True}
        with self._client.stream("POST", "/generate", json=body) as r:
            if r.status_code >= 400:
                r.read()
                raise_for_error(r.status_code, _json(r))
            for line in r.iter_lines():
                chunk = parse_sse_line(line)
                if chunk is not None:
                    yield chunk

    async def agenerate_stream(self, request: GenRequest) -> AsyncIterator[dict]:
        body = {**request_body(single_kwargs(request)), "stream": True}
        async with self._aclient().stream("POST", "/generate", json=body) as r:
            if r.status_code >= 400:
                await r.aread()
                raise_for_error(r.status_code, _json(r))
            async for line in r.aiter_lines():
                chunk = parse_sse_line(line)
                if chunk is not None:
                    yield chunk

    def flush_cache(self) -> bool:
        r = self._client.post("/flush_cache")
        if r.status_code == 400:  # busy: requests are running
            return False
        raise_for_error(r.status_code, _json(r))
        return True

    def get_server_info(self) -> dict[str, Any]:
        return self._get("/get_server_info")

    def shutdown(self) -> None:
        self._client.close()

    def __repr__(self) -> str:
        return f"RuntimeEndpoint({self.base_url!r})"


def _json(response) -> Any:
    try:
        return response.json()
    except ValueError:
        return response.text
