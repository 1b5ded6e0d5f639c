"""The public language: `function`, `gen`, `select`, roles. Names and signatures follow SGLang's
frontend, so its programs run unchanged with `import radixgen as sgl`."""

from __future__ import annotations

import json
import re
from typing import Any

from radixgen.lang.choices import ChoicesSamplingMethod, resolve_method, token_length_normalized
from radixgen.lang.ir import GEN_NAMES, Gen, Image, Node, RoleBegin, RoleEnd, Select, Seq
from radixgen.lang.program import Function, get_default_backend, resolve_backend, set_default_backend

__all__ = [
    "function",
    "gen",
    "gen_int",
    "gen_string",
    "select",
    "system",
    "user",
    "assistant",
    "system_begin",
    "system_end",
    "user_begin",
    "user_end",
    "assistant_begin",
    "assistant_end",
    "set_default_backend",
    "get_default_backend",
    "flush_cache",
    "get_server_info",
    "image",
    "video",
    "Runtime",
]


def function(func=None, num_api_spec_tokens: int | None = None):
    """Decorator: `@function` or `@function(...)` turns `def prog(s, ...)` into a program."""
    if func is not None:
        return Function(func, num_api_spec_tokens=num_api_spec_tokens)
    return lambda f: Function(f, num_api_spec_tokens=num_api_spec_tokens)


_DTYPE_NAMES = {int: "int", float: "float", str: "str", bool: "bool"}


def gen(
    name: str | None = None,
    max_tokens: int | None = None,
    min_tokens: int | None = None,
    n: int | None = None,
    stop: str | list[str] | None = None,
    stop_token_ids: list[int] | None = None,
    stop_regex: str | list[str] | None = None,
    temperature: float | None = None,
    top_p: float | None = None,
    top_k: int | None = None,
    min_p: float | None = None,
    frequency_penalty: float | None = None,
    presence_penalty: float | None = None,
    ignore_eos: bool | None = None,
    return_logprob: bool | None = None,
    logprob_start_len: int | None = None,
    top_logprobs_num: int | None = None,
    return_text_in_logprobs: bool | None = None,
    dtype: type | str | None = None,
    choices: list[str] | None = None,
    choices_method: ChoicesSamplingMethod | str | None = None,
    regex: str | None = None,
    json_schema: str | dict | None = None,
    *,
    tools: list | None = None,
    tool_choice: str = "auto",
    tool_call_parser: str = "hermes",
    parallel_tool_calls: bool = True,
    reasoning: bool | str = False,
    reasoning_parser: str = "qwen3",
    max_thinking_tokens: int | None = None,
) -> Node:
    """Generate text after the current state (stored in variable `name`). Arguments left None take
    the run's defaults (SGLang's names and order). `dtype` (int/float/str/bool: the output matches
    `ir.REGEX_INT`... and the variable holds that text), `regex` and `json_schema` constrain the
    output; with `choices` this is a `select` (scored from logprobs, never sampled).

    Agents (lang/agent.py): with `tools` (OpenAI function dicts or annotated Python functions) the calls
    in the output go to variable `<name>_calls` (a list of agent.ToolCall) and `name` holds the rest;
    tool_choice "required" or a tool's name makes the model call (a grammar in the tool-call format).
    `reasoning=True` (or a variable name) moves the think block to `<name>_reasoning` (or that name); a
    constraint (regex, json_schema, dtype, choices, tools) then starts after the think block, in the same
    request, and `max_thinking_tokens` closes the block at that budget. `choices` with reasoning are sampled
    under a grammar (a think block cannot be scored)."""
    given = dict(locals())  # every keyword, before anything below binds another name
    sampled_choices = None  # with reasoning: the answer is sampled under a choices grammar
    if choices is not None and reasoning:
        if choices_method is not None:
            raise ValueError("gen.choices_method: choices with reasoning are sampled, not scored")
        if isinstance(choices, str) or not choices or not all(isinstance(c, str) and c for c in choices):
            raise ValueError("gen.choices: must be a non-empty list of non-empty strings")
        sampled_choices, choices = json.dumps(list(choices)), None
    if choices is not None:
        return select(
            name,
            choices,
            0.0 if temperature is None else temperature,
            token_length_normalized if choices_method is None else choices_method,
        )
    if choices_method is not None:
        raise ValueError("gen.choices_method: only meaningful together with choices")
    if regex is not None:
        try:
            re.compile(regex)
        except re.error as e:
            raise ValueError(f"gen.regex: not a valid regular expression: {e}") from e
    if tools is not None:
        from radixgen.lang.agent import function_spec

        tools = json.dumps([function_spec(t) for t in tools])
    if reasoning is True:
        reasoning = f"{name}_reasoning"
    if dtype is not None and not isinstance(dtype, str):
        if dtype not in _DTYPE_NAMES:
            raise ValueError(f"gen.dtype: must be int, float, str or bool (got {dtype!r})")
        dtype = _DTYPE_NAMES[dtype]
    given.update(dtype=dtype, tools=tools, reasoning=reasoning or None)
    given["choices"] = sampled_choices
    del given["choices_method"]
    return Gen(**{GEN_NAMES.get(k, k): v for k, v in given.items()})


def _typed_gen(dtype: type):
    def typed(
        name: str | None = None,
        max_tokens: int | None = None,
        n: int | None = None,
        stop: str | list[str] | None = None,
        stop_token_ids: list[int] | None = None,
        stop_regex: str | list[str] | None = None,
        temperature: float | None = None,
        top_p: float | None = None,
        top_k: int | None = None,
        min_p: float | None = None,
        frequency_penalty: float | None = None,
        presence_penalty: float | None = None,
        ignore_eos: bool | None = None,
        return_logprob: bool | None = None,
        logprob_start_len: int | None = None,
        top_logprobs_num: int | None = None,
        return_text_in_logprobs: bool | None = None,
    ) -> Node:
        kwargs = dict(locals())
        kwargs.pop("dtype", None)
        return gen(**kwargs, dtype=dtype)

    return typed


gen_int = _typed_gen(int)
gen_int.__name__ = gen_int.__qualname__ = "gen_int"
gen_int.__doc__ = """`gen(dtype=int)`: an integer, as text (the variable holds e.g. " 24": `int(s[name])`)."""
gen_string = _typed_gen(str)
gen_string.__name__ = gen_string.__qualname__ = "gen_string"
gen_string.__doc__ = """`gen(dtype=str)`: a double-quoted string; the variable holds the text, quotes included."""


def select(
    name: str | None = None,
    choices: list[str] | None = None,
    temperature: float = 0.0,
    choices_method: ChoicesSamplingMethod | str = token_length_normalized,
) -> Node:
    """Append the choice the model finds likeliest after the current state, scored from the prompt
    logprobs of each choice (never by sampling text). Scores are in `s.get_meta_info(name)`."""
    if choices is None:
        raise ValueError("select.choices: required")
    return Select(name, tuple(choices), temperature, resolve_method(choices_method))


def _role(role: str, expr: Any = None) -> Node:
    if expr is None:
        return Seq((RoleBegin(role), RoleEnd(role)))
    return Seq.of(RoleBegin(role), expr, RoleEnd(role))


def system(expr: Any = None) -> Node:
    return _role("system", expr)


def user(expr: Any = None) -> Node:
    return _role("user", expr)


def assistant(expr: Any = None) -> Node:
    return _role("assistant", expr)


def system_begin() -> Node:
    return RoleBegin("system")


def system_end() -> Node:
    return RoleEnd("system")


def user_begin() -> Node:
    return RoleBegin("user")


def user_end() -> Node:
    return RoleEnd("user")


def assistant_begin() -> Node:
    return RoleBegin("assistant")


def assistant_end() -> Node:
    return RoleEnd("assistant")


def image(expr: Any) -> Node:
    """An image at this point of the prompt, inside a role (`user(image(x) + "What is this?")`) or in plain
    text (`s += image(x)`): a path, bytes, a PIL image, base64 or a data URL. The model's image placeholder goes
    into the text; every later request of the program (and of its forks) carries the image."""
    if expr is None or not (isinstance(expr, (str, bytes, bytearray)) or hasattr(expr, "size") or
                            hasattr(expr, "__fspath__")):
        raise TypeError(f"image(): expected a path, bytes, a PIL image, base64 or a data URL, got "
                        f"{type(expr).__name__}")
    if isinstance(expr, str) and not expr:
        raise ValueError("image(): the image source is empty")
    return Image(expr)


def video(path: str, num_frames: int) -> Node:
    raise NotImplementedError("video(): video input is not supported (images are: image(x))")


def flush_cache(backend: Any = None) -> bool:
    return resolve_backend(backend).flush_cache()


def get_server_info(backend: Any = None) -> dict[str, Any]:
    return resolve_backend(backend).get_server_info()


def Runtime(model_path: str | None = None, **config: Any):  # noqa: N802 - SGLang's public name
    """An in-process runtime as a backend: `EngineBackend(Engine(model_path, **config))`, shut down
    with `.shutdown()` (SGLang's Runtime starts a server; here nothing leaves the process)."""
    from radixgen.lang.backend_engine import EngineBackend

    return EngineBackend.start(model_path, **config)
