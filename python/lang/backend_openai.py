"""OpenAI: programs run against any OpenAI-compatible `/v1` server through the `openai` package.

Chat models get the conversation as messages (a gen must open an assistant turn); completion
models get the text. `regex` and `json_schema` go in the request (extra body / response_format)
for servers that accept them. `select` needs prompt logprobs, which only the completions API
gives (`echo` + `logprobs`): with a chat model it is refused with a clear error.

Images (`image(x)` inside a turn) go to a chat model as OpenAI's content parts: the state's text holds
`IMAGE_MARK` where each image stands, and every request's messages carry, in place of each mark, an
`image_url` part with the image as a data URL (an http(s) URL as it is, for the server to fetch).
"""

from __future__ import annotations

import json
import os
from collections.abc import AsyncIterator, Iterator
from typing import Any

from radixgen.common.sampling_params import default_of
from radixgen.lang.backend_base import BaseBackend, GenRequest, ScoredChoices
from radixgen.lang.chat import ChatTemplate
from radixgen.lang.choices import TokenLogprobs
from radixgen.lang.ir import SAMPLING_FIELDS

# The gen sampling fields _kwargs maps by name onto the OpenAI body (every other one goes in the extra body as is).
_MAPPED = frozenset(("max_new_tokens", "temperature", "top_p", "frequency_penalty", "presence_penalty", "stop",
                     "top_k", "min_p", "ignore_eos", "min_new_tokens", "stop_token_ids", "stop_regex"))

COMPLETION_ONLY_MODELS = ("gpt-3.5-turbo-instruct", "davinci-002", "babbage-002")
IMAGE_MARK = "<image>"  # an image's place in the state's text (and in the messages, until they are sent)


class OpenAI(BaseBackend):
    can_prefill = False  # no cache control over the API

    def __init__(
        self,
        model_name: str,
        is_chat_model: bool | None = None,
        base_url: str | None = None,
        api_key: str | None = None,
        chat_template: str | None = None,
        **client_kwargs: Any,
    ):
        import openai

        if api_key is None and base_url is not None and not os.environ.get("OPENAI_API_KEY"):
            api_key = "EMPTY"  # a local server without a key still needs a value for the client
        self.model_name = model_name
        self.is_chat_model = model_name not in COMPLETION_ONLY_MODELS if is_chat_model is None else is_chat_model
        self.client = openai.OpenAI(base_url=base_url, api_key=api_key, **client_kwargs)
        self.aclient = openai.AsyncOpenAI(base_url=base_url, api_key=api_key, **client_kwargs)
        self._template_source = chat_template

    @property
    def model_info(self) -> dict[str, Any]:
        return {"model_name": self.model_name, "chat_template": self._template_source}

    @property
    def image_token(self) -> str | None:
        return IMAGE_MARK if self.is_chat_model else None

    @property
    def no_image_message(self) -> str:
        return (f"image(): the completions API of {self.model_name!r} takes no images; use a chat model "
                "(OpenAI(..., is_chat_model=True)), which gets them as image_url content parts")

    @property
    def chat_template(self) -> ChatTemplate:
        # Only for the text of the state: a chat model gets messages.
        if self._template_source:
            return ChatTemplate.from_jinja(self._template_source)
        return ChatTemplate.chatml()

    # ---- request building
    def _kwargs(self, request: GenRequest, stream: bool) -> dict[str, Any]:
        p = request.sampling_params
        kwargs: dict[str, Any] = {
            "model": request.lora_name or self.model_name,  # a LoRA adapter is a model name on OpenAI-shaped servers
            "max_tokens": p["max_new_tokens"],
            "temperature": p["temperature"],
            "top_p": p["top_p"],
            "frequency_penalty": p["frequency_penalty"],
            "presence_penalty": p["presence_penalty"],
            "n": p.get("n", 1),
        }
        if p["stop"]:
            kwargs["stop"] = p["stop"]
        extra: dict[str, Any] = {}
        for key, default in (("top_k", -1), ("min_p", 0.0), ("ignore_eos", False)):
            if p[key] != default:
                extra[key] = p[key]
        if p["min_new_tokens"]:
            extra["min_tokens"] = p["min_new_tokens"]
        if p["stop_token_ids"]:
            extra["stop_token_ids"] = p["stop_token_ids"]
        for key in ("skip_special_tokens", "spaces_between_special_tokens"):  # set by global_config
            if key in p:
                extra[key] = p[key]
        if "stop_regex" in p:
            extra["stop_regex"] = p["stop_regex"]
        for key in SAMPLING_FIELDS:  # a declared parameter without its own mapping above: the extra body, by name
            if key not in _MAPPED and key in p and p[key] != default_of(key):
                extra[key] = p[key]
        if "regex" in p:
            extra["regex"] = p["regex"]
        if "ebnf" in p:  # SGLang's extra body (gen with tools and a tool_choice that forces a call)
            extra["ebnf"] = p["ebnf"]
        if "max_thinking_tokens" in p:  # gen(reasoning=True, max_thinking_tokens=N): the server closes the block
            if not self.is_chat_model:
                raise ValueError("gen.max_thinking_tokens: an OpenAI completions endpoint takes no thinking budget "
                                 "(a chat model's does)")
            extra["max_thinking_tokens"] = p["max_thinking_tokens"]
        if "json_schema" in p:
            if self.is_chat_model:
                schema = {"name": "output", "schema": json.loads(p["json_schema"])}
                kwargs["response_format"] = {"type": "json_schema", "json_schema": schema}
            else:
                extra["json_schema"] = p["json_schema"]
        if request.return_logprob:
            if self.is_chat_model:
                kwargs["logprobs"] = True
                if request.top_logprobs_num:
                    kwargs["top_logprobs"] = request.top_logprobs_num
            else:
                kwargs["logprobs"] = request.top_logprobs_num or 1
        if extra:
            kwargs["extra_body"] = extra
        if stream:
            kwargs["stream"] = True
        if self.is_chat_model:
            kwargs["messages"] = self._messages(request)
        else:
            kwargs["prompt"] = request.text
        return kwargs

    def _messages(self, request: GenRequest) -> list[dict[str, str]]:
        chat = request.chat
        if chat is None or chat.role != "assistant":
            raise ValueError(
                f"with the chat model {self.model_name!r}, a gen must be inside an assistant turn: "
                "s += assistant(gen(...))"
            )
        if chat.partial:
            raise ValueError(
                f"with the chat model {self.model_name!r}, a gen must come first in its assistant turn: "
                "the chat API cannot continue a partial message"
            )
        return with_image_parts(chat.messages, request.images) if request.images else chat.messages

    def _result(self, response: Any) -> list[dict]:
        out = []
        usage = getattr(response, "usage", None)
        for choice in response.choices:
            text = choice.message.content if self.is_chat_model else choice.text
            meta: dict[str, Any] = {
                "id": response.id,
                "finish_reason": {"type": choice.finish_reason},
                "prompt_tokens": getattr(usage, "prompt_tokens", None),
                "completion_tokens": getattr(usage, "completion_tokens", None),
            }
            if choice.logprobs is not None:
                meta["output_token_logprobs"] = _output_logprobs(choice.logprobs, self.is_chat_model)
            out.append({"text": text or "", "meta_info": meta})
        return out

    # ---- generation
    def _generate_group(self, requests: list[GenRequest]) -> list[dict]:
        out = []
        for r in requests:
            api = self.client.chat.completions if self.is_chat_model else self.client.completions
            out += self._result(api.create(**self._kwargs(r, stream=False)))
        return out

    async def _agenerate_group(self, requests: list[GenRequest]) -> list[dict]:
        out = []
        for r in requests:
            api = self.aclient.chat.completions if self.is_chat_model else self.aclient.completions
            out += self._result(await api.create(**self._kwargs(r, stream=False)))
        return out

    def _chunk(self, event: Any, text: str) -> tuple[str, dict | None]:
        if not event.choices:
            return text, None
        choice = event.choices[0]
        delta = (choice.delta.content if self.is_chat_model else choice.text) or ""
        text += delta
        reason = {"type": choice.finish_reason} if choice.finish_reason else None
        return text, {"text": text, "delta": delta, "meta_info": {"id": event.id, "finish_reason": reason}}

    def generate_stream(self, request: GenRequest) -> Iterator[dict]:
        api = self.client.chat.completions if self.is_chat_model else self.client.completions
        text = ""
        for event in api.create(**self._kwargs(request, stream=True)):
            text, chunk = self._chunk(event, text)
            if chunk is not None:
                yield chunk

    async def agenerate_stream(self, request: GenRequest) -> AsyncIterator[dict]:
        api = self.aclient.chat.completions if self.is_chat_model else self.aclient.completions
        text = ""
        async for event in await api.create(**self._kwargs(request, stream=True)):
            text, chunk = self._chunk(event, text)
            if chunk is not None:
                yield chunk

    # ---- select
    def _score_kwargs(self, prompt: str, choice: str, lora_name: str | None) -> dict[str, Any]:
        if self.is_chat_model:
            raise NotImplementedError(
                f"select needs prompt logprobs, which the chat API of {self.model_name!r} does not give; "
                "use OpenAI(..., is_chat_model=False) with a server whose /v1/completions supports echo"
            )
        return {
            "model": lora_name or self.model_name,
            "prompt": prompt + choice,
            "max_tokens": 0,
            "echo": True,
            "logprobs": 1,
            "temperature": 0,
        }

    def score_choices(self, prompt: str, choices: list[str], unconditional: str | None,
                      lora_name: str | None = None, images: tuple = ()) -> ScoredChoices:
        def score(context: str) -> list[TokenLogprobs]:
            return [
                choice_span(self.client.completions.create(**self._score_kwargs(context, c, lora_name)), context, c)
                for c in choices
            ]

        return ScoredChoices(score(prompt), None if unconditional is None else score(unconditional))

    async def ascore_choices(self, prompt: str, choices: list[str], unconditional: str | None,
                             lora_name: str | None = None, images: tuple = ()) -> ScoredChoices:
        async def score(context: str) -> list[TokenLogprobs]:
            out = []
            for c in choices:
                response = await self.aclient.completions.create(**self._score_kwargs(context, c, lora_name))
                out.append(choice_span(response, context, c))
            return out

        return ScoredChoices(await score(prompt), None if unconditional is None else await score(unconditional))

    def shutdown(self) -> None:
        self.client.close()


def with_image_parts(messages: list[dict], images: tuple) -> list[dict]:
    """The messages with each IMAGE_MARK in their text replaced by an image_url part (the images in order)."""
    marks = sum(m["content"].count(IMAGE_MARK) for m in messages if isinstance(m.get("content"), str))
    if marks != len(images):
        raise ValueError(f"image(): the messages hold {marks} image places ({IMAGE_MARK!r}) for {len(images)} "
                         f"images (is {IMAGE_MARK!r} written in the text itself?)")
    from radixgen.common.media import to_data_url

    sources = iter(images)
    out = []
    for m in messages:
        pieces = m["content"].split(IMAGE_MARK) if isinstance(m.get("content"), str) else [None]
        if len(pieces) == 1:
            out.append(m)
            continue
        parts: list[dict] = []
        for k, piece in enumerate(pieces):
            if k:
                parts.append({"type": "image_url", "image_url": {"url": to_data_url(next(sources))}})
            if piece:
                parts.append({"type": "text", "text": piece})
        out.append({**m, "content": parts})
    return out


def choice_span(response: Any, prompt: str, choice: str) -> TokenLogprobs:
    """The echoed tokens that end past the prompt: the choice, plus a prompt token it merged with."""
    lp = response.choices[0].logprobs
    if lp is None or lp.token_logprobs is None or lp.text_offset is None:
        raise NotImplementedError("the server did not echo prompt logprobs: select cannot be scored")
    ends = [*lp.text_offset[1:], len(prompt) + len(choice)]
    tokens = [
        (float(logprob), -1, token)
        for token, logprob, end in zip(lp.tokens, lp.token_logprobs, ends, strict=True)
        if end > len(prompt) and logprob is not None
    ]
    if not tokens:
        raise ValueError(f"select: cannot score choice {choice!r}: there is no text before it")
    return tokens


def _output_logprobs(logprobs: Any, chat: bool) -> list[tuple[float, int, str]]:
    if chat:
        return [(c.logprob, -1, c.token) for c in logprobs.content or []]
    return [(lp, -1, tok) for tok, lp in zip(logprobs.tokens, logprobs.token_logprobs, strict=True)]
