"""The public language: `function`, `gen`, `select`, roles. Names and signatures follow SGLang's
frontend, so its programs run unchanged with `import radixgen as sgl`."""

from __future__ import annotations

import inspect
import json
import re
from typing import Any

from radixgen.common.constraint import constraint_text
from radixgen.common.sampling_params import param_type
from radixgen.lang.choices import ChoicesSamplingMethod, resolve_method, token_length_normalized
from radixgen.lang.ir import (
    GEN_NAMES,
    LANG_FIELDS,
    SAMPLING_FIELDS,
    Embed,
    Gen,
    Image,
    Node,
    RoleBegin,
    RoleEnd,
    Select,
    Seq,
)
from radixgen.lang.program import Function, get_default_backend, resolve_backend, set_default_backend

__all__ = [
    "function",
    "gen",
    "gen_int",
    "gen_string",
    "select",
    "embed",
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


# SGLang's gen in its order (programs pass the first ones positionally): the declared parameters among them
# under gen's spelling (ir.GEN_NAMES), the language's own between them. Every other declared parameter the
# language exposes (ir.LANG_FIELDS) follows as a keyword-only argument, so a new one is a gen keyword at once.
_GEN_ORDER = ("name", "max_tokens", "min_tokens", "n", "stop", "stop_token_ids", "stop_regex", "temperature", "top_p",
              "top_k", "min_p", "frequency_penalty", "presence_penalty", "ignore_eos", "return_logprob",
              "logprob_start_len", "top_logprobs_num", "return_text_in_logprobs", "dtype", "choices", "choices_method",
              "regex", "json_schema")
# The language's own arguments (not sampling parameters): annotation, default; those not in _GEN_ORDER are
# keyword-only.
_GEN_OWN: dict[str, tuple[Any, Any]] = {
    "name": (str | None, None),
    "return_logprob": (bool | None, None),
    "logprob_start_len": (int | None, None),
    "top_logprobs_num": (int | None, None),
    "return_text_in_logprobs": (bool | None, None),
    "dtype": (type | str | None, None),
    "choices_method": (ChoicesSamplingMethod | str | None, None),
    "tools": (list | None, None),
    "tool_choice": (str, "auto"),
    "tool_call_parser": (str, "hermes"),
    "parallel_tool_calls": (bool, True),
    "reasoning": (bool | str, False),
    "reasoning_parser": (str, "qwen3"),
}
_GEN_SPELLING = {v: k for k, v in GEN_NAMES.items()}  # declared name -> gen's keyword


def _gen_parameter(keyword: str, kind: Any) -> inspect.Parameter:
    if keyword in _GEN_OWN:
        annotation, default = _GEN_OWN[keyword]
        return inspect.Parameter(keyword, kind, default=default, annotation=annotation)
    declared = param_type(GEN_NAMES.get(keyword, keyword))
    return inspect.Parameter(keyword, kind, default=None, annotation=declared | None)


def _gen_signature() -> inspect.Signature:
    positional = [_gen_parameter(k, inspect.Parameter.POSITIONAL_OR_KEYWORD) for k in _GEN_ORDER]
    rest = [k for k in _GEN_OWN if k not in _GEN_ORDER]
    rest += [_GEN_SPELLING.get(n, n) for n in LANG_FIELDS if _GEN_SPELLING.get(n, n) not in _GEN_ORDER]
    return inspect.Signature(positional + [_gen_parameter(k, inspect.Parameter.KEYWORD_ONLY) for k in rest],
                             return_annotation=Node)


_GEN_SIGNATURE = _gen_signature()


def gen(*args: Any, **kwargs: Any) -> Node:
    """Generate text after the current state (stored in variable `name`). Arguments left None take
    the run's defaults (SGLang's names and order; the sampling ones are radixgen.common.sampling_params'
    declared parameters: `inspect.signature(gen)` lists them). `dtype` (int/float/str/bool: the output
    matches `ir.REGEX_INT`... and the variable holds that text), `regex` and `json_schema` constrain the
    output; with `choices` this is a `select` (scored from logprobs, never sampled).

    Agents (lang/agent.py): with `tools` (OpenAI function dicts or annotated Python functions) the calls
    in the output go to variable `<name>_calls` (a list of agent.ToolCall) and `name` holds the rest;
    tool_choice "required" or a tool's name makes the model call (a grammar in the tool-call format).
    `reasoning=True` (or a variable name) moves the think block to `<name>_reasoning` (or that name); a
    constraint (regex, json_schema, dtype, choices, tools) then starts after the think block, in the same
    request, and `max_thinking_tokens` closes the block at that budget. `choices` with reasoning are sampled
    under a grammar (a think block cannot be scored)."""
    bound = _GEN_SIGNATURE.bind(*args, **kwargs)
    bound.apply_defaults()
    given = dict(bound.arguments)  # every keyword, in gen's spelling
    name, choices, choices_method = given["name"], given["choices"], given.pop("choices_method")
    regex, tools, reasoning, dtype = given["regex"], given["tools"], given["reasoning"], given["dtype"]
    sampled_choices = None  # with reasoning: the answer is sampled under a choices grammar
    if choices is not None and reasoning:
        if choices_method is not None:
            raise ValueError("gen.choices_method: choices with reasoning are sampled, not scored")
        if isinstance(choices, str) or not choices or not all(isinstance(c, str) and c for c in choices):
            raise ValueError("gen.choices: must be a non-empty list of non-empty strings")
        sampled_choices, choices = constraint_text("choices", choices), None
    if choices is not None:
        temperature = given["temperature"]
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
    given.update(dtype=dtype, tools=tools, reasoning=reasoning or None, choices=sampled_choices)
    return Gen(**{GEN_NAMES.get(k, k): v for k, v in given.items()})


gen.__signature__ = _GEN_SIGNATURE  # type: ignore[attr-defined]

# The typed gens take gen's arguments up to the logprob options, less these (SGLang's gen_int / gen_string have
# no min_tokens), then every other declared parameter a gen passes through, keyword-only.
_TYPED_NOT_EXPOSED = ("min_tokens",)


def _typed_signature() -> inspect.Signature:
    params = list(_GEN_SIGNATURE.parameters.values())
    head = params[: _GEN_ORDER.index("return_text_in_logprobs") + 1]
    extra = [p for p in params if p.kind is p.KEYWORD_ONLY and GEN_NAMES.get(p.name, p.name) in SAMPLING_FIELDS]
    return inspect.Signature([p for p in head if p.name not in _TYPED_NOT_EXPOSED] + extra, return_annotation=Node)


_TYPED_SIGNATURE = _typed_signature()


def _typed_gen(dtype: type):
    def typed(*args: Any, **kwargs: Any) -> Node:
        bound = _TYPED_SIGNATURE.bind(*args, **kwargs)
        return gen(**bound.arguments, dtype=dtype)

    typed.__signature__ = _TYPED_SIGNATURE  # type: ignore[attr-defined]
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


def embed(name: str, dimensions: int | None = None) -> Node:
    """Store the embedding of the program's text so far as variable `name` (a list of floats); the backend's
    model must serve embeddings. `dimensions`: truncate (Matryoshka models only)."""
    return Embed(name, dimensions)


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
