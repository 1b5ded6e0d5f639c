"""The bodies of Ollama's API (/api/chat, /api/generate, /api/show) and their translation onto the OpenAI
request models, whose fields map onto the one request contract (common/sampling_params.py):

- `options`: num_predict -> max_tokens (-1 and -2: what the context leaves), repeat_penalty ->
  repetition_penalty, temperature / top_p / top_k / min_p / seed / stop / presence_penalty /
  frequency_penalty as they are; num_ctx is a smaller context window (the prompt must fit in it and
  generation ends where it is full). Sampling options radixgen lacks (mirostat, tfs_z, typical_p,
  repeat_last_n, num_keep, penalize_newline) and load-time options (num_gpu, num_thread, use_mmap, ...: set
  when the server starts) are a 400 naming them.
- `format`: "json" (a JSON object) or a JSON schema, enforced by the constraint engine.
- `think`: true / false / "low" | "medium" | "high"; thinking is separated (`thinking`) when the served model
  has a reasoning format; false asks the chat template not to think (enable_thinking false).
- `keep_alive` is accepted and has no effect: the served model is always loaded."""

from __future__ import annotations

import json
from typing import Any

from pydantic import Field, ValidationError

from radixgen.common.http_errors import bad_request
from radixgen.runtime.server.protocol import ChatCompletionRequest, CompletionRequest, _Strict

SAME_NAME_OPTIONS = ("temperature", "top_p", "top_k", "min_p", "seed", "stop", "presence_penalty",
                     "frequency_penalty")
RENAMED_OPTIONS = {"num_predict": "max_tokens", "repeat_penalty": "repetition_penalty"}
UNSUPPORTED_OPTIONS = {
    "mirostat": "mirostat sampling", "mirostat_tau": "mirostat sampling", "mirostat_eta": "mirostat sampling",
    "tfs_z": "tail-free sampling", "typical_p": "typical sampling",
    "repeat_last_n": "a repetition window (the penalties count the whole output)",
    "num_keep": "context shifting", "penalize_newline": "penalize_newline",
}
LOAD_OPTIONS = ("numa", "num_batch", "num_gpu", "main_gpu", "low_vram", "f16_kv", "logits_all", "vocab_only",
                "use_mmap", "use_mlock", "embedding_only", "num_thread")


class _Common(_Strict):
    model: str = Field(min_length=1)
    format: str | dict[str, Any] | None = None
    options: dict[str, Any] | None = None
    stream: bool = True
    keep_alive: str | int | float | None = None  # no effect: the model stays loaded
    think: bool | str | None = None


class OllamaChat(_Common):
    messages: list[dict[str, Any]] = Field(default_factory=list)
    tools: list[dict[str, Any]] | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None


class OllamaGenerate(_Common):
    prompt: str = ""
    suffix: str | None = None
    images: list[str] | None = None
    system: str | None = None
    template: str | None = None
    context: list[int] | None = None
    raw: bool = False


class OllamaShow(_Strict):
    model: str | None = None
    name: str | None = None  # the older spelling of `model`
    verbose: bool = False


class Options:
    """`options` checked: the request fields they set, and num_ctx (None: the model's context)."""

    def __init__(self, options: dict[str, Any] | None, context_length: int):
        self.fields: dict[str, Any] = {}
        self.num_ctx: int | None = None
        for name, value in (options or {}).items():
            if name in UNSUPPORTED_OPTIONS:
                raise bad_request(f"options.{name}: {UNSUPPORTED_OPTIONS[name]} is not supported by this server")
            if name in LOAD_OPTIONS:
                raise bad_request(f"options.{name}: a load-time option; this server's model is loaded when it "
                                  f"starts (see `radixgen serve --help`)")
            if name == "num_ctx":
                if not isinstance(value, int) or isinstance(value, bool) or not 1 <= value <= context_length:
                    raise bad_request(f"options.num_ctx: an integer in [1, {context_length}] (the model's context "
                                      f"length), got {value!r}")
                self.num_ctx = value
            elif name == "num_predict":
                if isinstance(value, int) and not isinstance(value, bool) and value in (-1, -2):
                    continue  # until the context is full
                self.fields["max_tokens"] = value
            elif name == "stop" and isinstance(value, list) and not value:
                continue
            elif name in RENAMED_OPTIONS or name in SAME_NAME_OPTIONS:
                self.fields[RENAMED_OPTIONS.get(name, name)] = value
            else:
                raise bad_request(f"options.{name}: unknown option")


def response_format(fmt: str | dict[str, Any] | None) -> dict[str, Any] | None:
    """`format` as an OpenAI response_format."""
    if fmt is None or fmt == "":
        return None
    if fmt == "json":
        return {"type": "json_object"}
    if isinstance(fmt, dict):
        return {"type": "json_schema", "json_schema": {"name": "format", "schema": fmt}}
    raise bad_request(f"format: \"json\" or a JSON schema object, got {fmt!r}")


def thinking_fields(think: bool | str | None) -> dict[str, Any]:
    if think is None or think is True:
        return {}
    if think is False:
        return {"chat_template_kwargs": {"enable_thinking": False}}
    if think in ("low", "medium", "high"):
        return {"reasoning_effort": think}
    raise bad_request(f"think: true, false, \"low\", \"medium\" or \"high\"; got {think!r}")


def _message(m: Any, i: int) -> dict[str, Any]:
    where = f"messages[{i}]"
    if not isinstance(m, dict):
        raise bad_request(f"{where}: a message is an object, got {type(m).__name__}")
    unknown = sorted(set(m) - {"role", "content", "images", "tool_calls", "tool_name", "thinking"})
    if unknown:
        raise bad_request(f"{where}: unknown fields {unknown}")
    role, content = m.get("role"), m.get("content", "")
    if role not in ("system", "user", "assistant", "tool"):
        raise bad_request(f"{where}.role: one of system, user, assistant, tool; got {role!r}")
    if not isinstance(content, str):
        raise bad_request(f"{where}.content: a string, got {type(content).__name__}")
    out: dict[str, Any] = {"role": role, "content": content}
    images = m.get("images") or []
    if images:
        if not isinstance(images, list) or not all(isinstance(x, str) for x in images):
            raise bad_request(f"{where}.images: a list of base64 strings")
        out["content"] = [{"type": "text", "text": content},
                          *({"type": "image_url", "image_url": {"url": x}} for x in images)]
    calls = m.get("tool_calls") or []
    if calls:
        if role != "assistant" or not isinstance(calls, list):
            raise bad_request(f"{where}.tool_calls: a list, on assistant messages only")
        out["tool_calls"] = []
        for j, c in enumerate(calls):
            fn = c.get("function") if isinstance(c, dict) else None
            if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
                raise bad_request(f"{where}.tool_calls[{j}].function: an object with a name and arguments")
            args = fn.get("arguments", {})
            out["tool_calls"].append({"type": "function", "function": {
                "name": fn["name"], "arguments": args if isinstance(args, str) else json.dumps(args)}})
    if role == "tool" and m.get("tool_name") is not None:
        out["name"] = m["tool_name"]
    return out  # `thinking` of an earlier turn: not rendered again (chat templates drop it)


def _validated(model: type, body: dict[str, Any]) -> Any:
    try:
        return model.model_validate_json(json.dumps({k: v for k, v in body.items() if v is not None}))
    except ValidationError as e:
        err = e.errors()[0]
        msg = str(err["msg"]).removeprefix("Value error, ")
        loc = ".".join(str(x) for x in err["loc"])
        raise bad_request(f"{loc}: {msg}" if loc else msg) from None


def chat_request(req: OllamaChat | OllamaGenerate, messages: list[dict[str, Any]],
                 opts: Options) -> ChatCompletionRequest:
    """The chat request of /api/chat (or of /api/generate through the template)."""
    if req.think is not None and not isinstance(req.think, bool) and isinstance(req, OllamaGenerate) and req.raw:
        raise bad_request("think: needs the chat template (raw false)")
    tools = getattr(req, "tools", None)
    body = {"model": req.model, "messages": [_message(m, i) for i, m in enumerate(messages)], "tools": tools or None,
            "response_format": response_format(req.format), "stream": req.stream, **thinking_fields(req.think),
            **opts.fields}
    if not body["messages"]:
        raise bad_request("messages: no messages to answer")
    if body["messages"][-1]["role"] == "assistant":  # a prefilled answer: continued
        body["continue_final_message"] = True
    return _validated(ChatCompletionRequest, body)


def completion_request(req: OllamaGenerate, opts: Options) -> CompletionRequest:
    """The completion request of a raw /api/generate (the prompt as it is, no template)."""
    out = _validated(CompletionRequest, {"model": req.model, "prompt": req.prompt, "stream": req.stream,
                                         **opts.fields})
    if "max_tokens" not in opts.fields:
        out.max_tokens = None  # what the context leaves (CompletionRequest's own default is 16)
    return out


def check_generate(req: OllamaGenerate) -> None:
    if req.suffix:
        raise bad_request("suffix: fill-in-the-middle is not supported by this server")
    if req.template:
        raise bad_request("template: the served model's own chat template is used (raw true sends the prompt as is)")
    if req.raw and (req.system or req.images):
        raise bad_request("raw: a raw prompt takes no system message and no images")


def check_chat(req: OllamaChat) -> None:
    if req.logprobs or req.top_logprobs:
        raise bad_request("logprobs: not supported on /api/chat by this server (the OpenAI API has them)")
