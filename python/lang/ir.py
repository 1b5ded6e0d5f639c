"""The program IR: the expressions a program appends with `s += ...`, executed in order.

Expressions are small immutable dataclasses; `+` concatenates them (strings become `Text`) into a
`Seq`, so `"Q: " + q + gen("a")` is one expression. The interpreter `match`es over these classes.
"""

from __future__ import annotations

import os
import sys
import warnings
from dataclasses import dataclass
from typing import Any

from radixgen.common.constraint import TooManyConstraints, constraint_text, normalize_constraint
from radixgen.common.sampling_params import check_param, param_type, sampling_fields

# The texts a typed gen may write (SGLang's names). A number is SGLang's pattern: no leading space (a prompt
# ends in "A: "), then trailing spaces or newlines, which are also its stops (DTYPE_STOPS): the model ends the
# number as it ends a line, where with EOS as the only way out a small model ran on to a row of digits. Its
# digits are bounded here (SGLang's are not): a small model asked for pi in a chat turn wrote "1.00898666..."
# up to max_tokens. Bool and str end with their own last character; each allows the space a model writes first.
REGEX_INT = r"[-+]?[0-9]{1,19}[ \n]*"  # an optionally signed decimal integer
REGEX_FLOAT = r"[-+]?[0-9]{0,16}\.?[0-9]{1,16}[ \n]*"  # an integer or a decimal fraction
REGEX_BOOL = r" ?(True|False)"  # a Python bool literal
REGEX_STR = r' ?"[^"\\\x00-\x1f]*"'  # a double-quoted string without escapes (valid JSON too)


class Node:
    """Base of every IR expression; `a + b` builds a flat `Seq`."""

    __slots__ = ()

    def __add__(self, other: Any) -> Seq:
        return Seq.of(self, other)

    def __radd__(self, other: Any) -> Seq:
        return Seq.of(other, self)


def as_node(x: Any) -> Node:
    match x:
        case Node():
            return x
        case str():
            return Text(x)
        case _:
            raise TypeError(
                f"cannot append a {type(x).__name__} to a program: expected a str or an expression "
                "(gen, select, a role, ...); convert values with str() first"
            )


@dataclass(frozen=True)
class Seq(Node):
    items: tuple[Node, ...]

    @staticmethod
    def of(*parts: Any) -> Seq:
        items: list[Node] = []
        for part in parts:
            node = as_node(part)
            items.extend(node.items if isinstance(node, Seq) else (node,))
        return Seq(tuple(items))


@dataclass(frozen=True)
class Text(Node):
    value: str


@dataclass(frozen=True, eq=False)
class Image(Node):
    """An image in the text: the backend's image placeholder there, the source sent with every request whose
    prompt holds it (a path, bytes, a PIL image, base64 or a data URL; common/media.py)."""

    source: Any


# gen()'s keyword -> the declared parameter, where SGLang spells it differently
GEN_NAMES = {"max_tokens": "max_new_tokens", "min_tokens": "min_new_tokens"}
# Declared parameters (radixgen.common.sampling_params) that are not keywords of the language's gen / run: SGLang's
# gen has none of them, and a program's requests keep the declared defaults. think_end: gen(reasoning=True) sets
# it from the model's reasoning format. Every other declared parameter is a gen keyword and a Gen field
# (tests/common/test_sampling_contract.py).
LANG_NOT_EXPOSED = frozenset(("repetition_penalty", "skip_special_tokens", "no_stop_trim", "seed", "ebnf",
                              "logit_bias", "think_end"))
# Declared parameters a gen gives a meaning of its own, beyond the request: n samples into a list, regex and
# json_schema beside dtype, choices make a select (or, with reasoning, a sampled grammar), max_thinking_tokens
# goes with reasoning.
GEN_SPECIAL = ("n", "regex", "json_schema", "choices", "max_thinking_tokens")
# The declared parameters a gen takes; those it passes to its request as they are (None: the run's default).
LANG_FIELDS = tuple(f.name for f in sampling_fields() if f.name not in LANG_NOT_EXPOSED)  # gen's, in order
SAMPLING_FIELDS = tuple(name for name in LANG_FIELDS if name not in GEN_SPECIAL)
# Logprob options: not sampling parameters, they shape what comes back.
LOGPROB_FIELDS = ("return_logprob", "logprob_start_len", "top_logprobs_num", "return_text_in_logprobs")


def with_declared_fields(names: tuple[str, ...], default: Any = None, after: str | None = None):
    """Class decorator, under @dataclass: a field per declared parameter in `names` (typed as declared,
    `default(name)` or None as its default), placed after field `after` (None: first), so the record follows the
    declaration instead of repeating it."""

    def add(cls: type) -> type:
        own = dict(cls.__dict__.get("__annotations__", {}))
        keys = list(own)
        cut = 0 if after is None else keys.index(after) + 1
        added = {name: param_type(name) | None for name in names if name not in own}
        cls.__annotations__ = {**{k: own[k] for k in keys[:cut]}, **added, **{k: own[k] for k in keys[cut:]}}
        for name in added:
            setattr(cls, name, None if default is None else default(name))
        return cls

    return add


DTYPE_REGEX = {"int": REGEX_INT, "float": REGEX_FLOAT, "bool": REGEX_BOOL, "str": REGEX_STR}
DTYPES = tuple(DTYPE_REGEX)
# Stop strings a typed gen adds to its own (SGLang's): the whitespace that ends a number is not kept.
DTYPE_STOPS = {"int": (" ", "\n"), "float": (" ", "\n"), "bool": (), "str": ()}


@dataclass(frozen=True)
@with_declared_fields(LANG_FIELDS, after="name")
class Gen(Node):
    """One gen: a field per declared parameter the language exposes (LANG_FIELDS; None: the run's default;
    `choices` is a JSON list of strings the answer is sampled from, with reasoning), then the language's own."""

    name: str | None = None
    return_logprob: bool | None = None
    logprob_start_len: int | None = None
    top_logprobs_num: int | None = None
    return_text_in_logprobs: bool | None = None
    dtype: str | None = None  # one of DTYPES: the output matches DTYPE_REGEX (the variable holds the text)
    # ---- agents (issue 29, lang/agent.py): calls and thinking read out of the output
    tools: str | None = None  # a JSON list of OpenAI function specs: the calls go to variable `<name>_calls`
    tool_choice: str = "auto"  # "auto", "required" or a tool's name (then a grammar makes the model call)
    tool_call_parser: str = "hermes"
    parallel_tool_calls: bool = True
    reasoning: str | None = None  # the variable that holds the think block (None: it stays in the answer)
    reasoning_parser: str = "qwen3"
    # ---- end of issue 29's fields

    def __post_init__(self) -> None:
        check_name(self.name, "gen")
        if (self.tools is not None or self.reasoning is not None) and not self.name:
            raise ValueError("gen: tools / reasoning need a variable name (the parts go into variables)")
        if self.tools is not None and self.tool_choice != "auto" and (self.regex or self.json_schema or self.dtype):
            raise ValueError("gen: a tool_choice other than auto is a constraint; no regex / json_schema / dtype too")
        if (self.tools is not None or self.reasoning is not None) and self.n not in (None, 1):
            raise ValueError("gen: tools / reasoning take n=1")
        if self.reasoning is None and (self.max_thinking_tokens is not None or self.choices is not None):
            raise ValueError("gen: max_thinking_tokens (and sampled choices) need reasoning=True")
        check_param("max_thinking_tokens", self.max_thinking_tokens, "gen")
        if self.choices is not None and (self.regex or self.json_schema or self.dtype or self.tools):
            raise ValueError("gen: choices are a constraint; no regex / json_schema / dtype / tools too")
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        elif self.stop is not None:
            object.__setattr__(self, "stop", tuple(self.stop))
        if self.stop_token_ids is not None:
            object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        object.__setattr__(self, "json_schema", constraint_text("json_schema", self.json_schema))
        if isinstance(self.stop_regex, (list, tuple)):  # SGLang takes a list: stop at any of them
            object.__setattr__(self, "stop_regex", join_patterns(self.stop_regex))
        if self.dtype is not None and self.dtype not in DTYPES:
            raise ValueError(f"gen.dtype: must be one of int, float, str, bool (got {self.dtype!r})")
        if self.dtype is not None and self.regex is not None:
            warnings.warn(
                f"gen {self.name!r}: both dtype and regex are set; the dtype's regex is used "
                f"(dtype={self.dtype}, regex={self.regex!r})",
                stacklevel=user_stacklevel(),
            )
        pattern = ("dtype", self.dtype) if self.dtype is not None else ("regex", self.regex)  # a dtype is a regex
        try:
            normalize_constraint(dict([pattern, ("json_schema", self.json_schema)]), kinds={"dtype": "regex"})
        except TooManyConstraints as e:
            raise ValueError(f"gen: at most one of dtype/regex and json_schema may be set, got {e.given}") from None
        if self.n is not None:
            check_param("n", self.n, "gen")

    def sampling_overrides(self) -> dict[str, Any]:
        """The sampling fields this gen sets explicitly."""
        return {k: getattr(self, k) for k in SAMPLING_FIELDS if getattr(self, k) is not None}


@dataclass(frozen=True)
class Select(Node):
    name: str | None
    choices: tuple[str, ...]
    temperature: float
    method: Any  # a choices method (radixgen.lang.choices); Any keeps ir free of that import

    def __post_init__(self) -> None:
        check_name(self.name, "select")
        if isinstance(self.choices, str) or not self.choices:
            raise ValueError("select.choices: must be a non-empty list of strings")
        object.__setattr__(self, "choices", tuple(self.choices))
        if not all(isinstance(c, str) and c for c in self.choices):
            raise ValueError(f"select.choices: every choice must be a non-empty string (got {self.choices!r})")
        t = self.temperature
        if not isinstance(t, (int, float)) or isinstance(t, bool) or t < 0:
            raise ValueError(f"select.temperature: must be a number >= 0 (got {t!r})")


@dataclass(frozen=True)
class Embed(Node):
    """The embedding of the program's text so far (a pooling model's vector), stored as variable `name`."""

    name: str
    dimensions: int | None = None  # Matryoshka truncation, where the model allows it

    def __post_init__(self) -> None:
        check_name(self.name, "embed")
        if self.name is None:
            raise ValueError("embed.name: the vector needs a variable name")
        d = self.dimensions
        if d is not None and (not isinstance(d, int) or isinstance(d, bool) or d < 1):
            raise ValueError(f"embed.dimensions: must be a positive integer or None (got {d!r})")


@dataclass(frozen=True)
class RoleBegin(Node):
    role: str


@dataclass(frozen=True)
class RoleEnd(Node):
    role: str


@dataclass(frozen=True)
class VarScopeBegin(Node):
    name: str


@dataclass(frozen=True)
class VarScopeEnd(Node):
    name: str


@dataclass(frozen=True)
class SetVar(Node):
    name: str
    value: Any


@dataclass(frozen=True, eq=False)
class Fork(Node):
    """Internal: copy the state into `children` once everything before it has run."""

    children: tuple[Any, ...]


@dataclass(frozen=True, eq=False)
class Join(Node):
    """Internal: wait for `children` and merge them back (mode: gather_variable | concate_and_append)."""

    children: tuple[Any, ...]
    mode: str


def join_patterns(patterns: list[str] | tuple[str, ...]) -> str | None:
    """One regular expression that matches where any of `patterns` does (None for none)."""
    if len(patterns) <= 1:
        return patterns[0] if patterns else None
    return "|".join(f"(?:{p})" for p in patterns)


def user_stacklevel() -> int:
    """The `stacklevel` of a warning raised here that points at the program line (the first frame
    outside radixgen.lang and generated code such as a dataclass __init__)."""
    lang_dir = os.path.dirname(os.path.abspath(__file__)) + os.sep
    frame, level = sys._getframe(1), 1
    while frame is not None and (
        (frame.f_code.co_filename.startswith("<") and frame.f_code.co_name == "__init__")  # a dataclass's
        or os.path.abspath(frame.f_code.co_filename).startswith(lang_dir)
    ):
        frame, level = frame.f_back, level + 1
    return level


def check_name(name: Any, what: str) -> None:
    if name is not None and (not isinstance(name, str) or not name):
        raise ValueError(f"{what}.name: must be a non-empty string or None (got {name!r})")
