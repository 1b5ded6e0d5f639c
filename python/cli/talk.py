"""One streamed generation for `chat` and `complete`, on an in-process Engine or a server's OpenAI API: text
pieces as they come, then the turn's figures (tokens, time, prompt tokens that came from the radix cache)."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from typing import Any, NamedTuple

# SamplingParams names the OpenAI body spells otherwise (the server's own map, for a client of it)
OPENAI_NAMES = {"max_new_tokens": "max_tokens", "min_new_tokens": "min_tokens"}


class TurnStats(NamedTuple):
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    seconds: float  # from sending to the last piece
    first_token_s: float | None

    @property
    def tokens_per_s(self) -> float:
        decode = self.seconds - (self.first_token_s or 0.0)
        return (self.completion_tokens - 1) / decode if self.completion_tokens > 1 and decode > 0 else 0.0

    def line(self) -> str:
        ttft = "" if self.first_token_s is None else f", first token {self.first_token_s * 1000:.0f} ms"
        return (f"[{self.completion_tokens} tokens, {self.tokens_per_s:.1f} tok/s{ttft}; prompt {self.prompt_tokens}"
                f" tokens, {self.cached_tokens} from the cache]")


class LocalModel:
    """An in-process Engine. The chat is rendered with the model's own template (common/chat_render)."""

    def __init__(self, engine) -> None:
        self.engine = engine
        self.name = engine.model_info["model_name"]
        self.last: TurnStats | None = None

    def chat(self, messages: list[dict], sampling: dict[str, Any]) -> Iterator[str]:
        from radixgen.common.chat_render import render_chat

        text = render_chat(self.engine.tokenizer, messages)
        (ids,) = self.engine.tokenize([text], add_special_tokens=False)  # the template wrote the special tokens
        return self._stream(dict(input_ids=ids), sampling)

    def complete(self, prompt: str, sampling: dict[str, Any]) -> Iterator[str]:
        return self._stream(dict(prompt=prompt), sampling)

    def _stream(self, what: dict, sampling: dict[str, Any]) -> Iterator[str]:
        self.last = None
        t0 = time.perf_counter()
        first = None
        meta: dict = {}
        chunks = self.engine.generate(sampling_params=sampling, stream=True, **what)
        try:
            for chunk in chunks:
                meta = chunk["meta_info"]
                if chunk.get("delta"):
                    first = first if first is not None else time.perf_counter() - t0
                    yield chunk["delta"]
        finally:
            chunks.close()  # an interrupted reply is aborted here
            self.last = TurnStats(meta.get("prompt_tokens", 0), meta.get("cached_tokens", 0),
                                  meta.get("completion_tokens", 0), time.perf_counter() - t0, first)

    def close(self) -> None:
        self.engine.shutdown()


class RemoteError(RuntimeError):
    """A server's refusal, with its own message."""


class RemoteModel:
    """A server's /v1/chat/completions and /v1/completions, streamed (usage in the last chunk)."""

    def __init__(self, url: str, api_key: str | None, model: str | None = None) -> None:
        import httpx

        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.client = httpx.Client(base_url=url.rstrip("/"), headers=headers, timeout=httpx.Timeout(600.0,
                                                                                                   connect=10.0))
        self.name = model or self._first_model()
        self.last: TurnStats | None = None

    def _first_model(self) -> str:
        import httpx

        try:
            r = self.client.get("/v1/models")
        except httpx.HTTPError as e:
            raise RemoteError(f"cannot reach {self.client.base_url}: {e}") from None
        if r.status_code != 200:
            raise RemoteError(f"GET /v1/models: {r.status_code} {_error_text(r.text)}")
        data = r.json().get("data") or []
        if not data:
            raise RemoteError("the server lists no model at /v1/models")
        return data[0]["id"]

    def _body(self, sampling: dict[str, Any]) -> dict[str, Any]:
        body = {OPENAI_NAMES.get(k, k): v for k, v in sampling.items()}
        return {"model": self.name, "stream": True, "stream_options": {"include_usage": True}, **body}

    def chat(self, messages: list[dict], sampling: dict[str, Any]) -> Iterator[str]:
        return self._stream("/v1/chat/completions", {"messages": messages, **self._body(sampling)},
                            lambda choice: (choice.get("delta") or {}).get("content"))

    def complete(self, prompt: str, sampling: dict[str, Any]) -> Iterator[str]:
        return self._stream("/v1/completions", {"prompt": prompt, **self._body(sampling)},
                            lambda choice: choice.get("text"))

    def _stream(self, path: str, body: dict, piece_of) -> Iterator[str]:
        self.last = None
        t0 = time.perf_counter()
        first, usage = None, {}
        import httpx

        try:
            with self.client.stream("POST", path, json=body) as r:  # leaving it closes the connection: an abort
                if r.status_code != 200:
                    raise RemoteError(f"{r.status_code}: {_error_text(r.read().decode(errors='replace'))}")
                for line in r.iter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    event = json.loads(line[6:])
                    if "error" in event:
                        raise RemoteError(_error_text(json.dumps(event)))
                    usage = event.get("usage") or usage
                    for choice in event.get("choices") or []:
                        piece = piece_of(choice)
                        if piece:
                            first = first if first is not None else time.perf_counter() - t0
                            yield piece
        except httpx.HTTPError as e:
            raise RemoteError(f"{path}: {type(e).__name__}: {e}") from None
        finally:
            cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
            self.last = TurnStats(usage.get("prompt_tokens", 0), cached or 0, usage.get("completion_tokens", 0),
                                  time.perf_counter() - t0, first)

    def close(self) -> None:
        self.client.close()


def _error_text(text: str) -> str:
    """The message of an OpenAI-shaped error body, else the text."""
    try:
        err = json.loads(text).get("error")
    except (ValueError, AttributeError):
        return text.strip()[:500]
    if isinstance(err, dict):
        return str(err.get("message", err))
    return str(err) if err else text.strip()[:500]
