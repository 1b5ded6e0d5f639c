"""The program IR: the expressions a program appends with `s += ...`, executed in order.

Expressions are small immutable dataclasses; `+` concatenates them (strings become `Text`) into a
`Seq`, so `"Q: " + q + gen("a")` is one expression. The interpreter `match`es over these classes.
"""

from __future__ import annotations

import json
import os
import sys
import warnings
from dataclasses import dataclass
from typing import Any

from radixgen.common.constraint import TooManyConstraints, normalize_constraint

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


# The sampling fields a `gen` may set (radixgen.common.sampling_params declares each; tests/common/
# test_sampling_contract.py fails when a declared one is neither here nor listed as not exposed); None means
# "the run's default". `n` and the constraints (regex, json_schema, dtype; choices via select) are Gen fields too.
SAMPLING_FIELDS = (
    "max_new_tokens",
    "min_new_tokens",
    "stop",
    "stop_token_ids",
    "stop_regex",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "frequency_penalty",
    "presence_penalty",
    "ignore_eos",
)
# gen()'s keyword -> the declared parameter, where SGLang spells it differently
GEN_NAMES = {"max_tokens": "max_new_tokens", "min_tokens": "min_new_tokens"}
# Logprob options: not sampling parameters, they shape what comes back.
LOGPROB_FIELDS = ("return_logprob", "logprob_start_len", "top_logprobs_num", "return_text_in_logprobs")
DTYPE_REGEX = {"int": REGEX_INT, "float": REGEX_FLOAT, "bool": REGEX_BOOL, "str": REGEX_STR}
DTYPES = tuple(DTYPE_REGEX)
# Stop strings a typed gen adds to its own (SGLang's): the whitespace that ends a number is not kept.
DTYPE_STOPS = {"int": (" ", "\n"), "float": (" ", "\n"), "bool": (), "str": ()}


@dataclass(frozen=True)
class Gen(Node):
    name: str | None = None
    max_new_tokens: int | None = None
    min_new_tokens: int | None = None
    stop: tuple[str, ...] | None = None
    stop_token_ids: tuple[int, ...] | None = None
    stop_regex: str | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    ignore_eos: bool | None = None
    n: int | None = None  # None: the run's n
    return_logprob: bool | None = None
    logprob_start_len: int | None = None
    top_logprobs_num: int | None = None
    return_text_in_logprobs: bool | None = None
    dtype: str | None = None  # one of DTYPES: the output matches DTYPE_REGEX (the variable holds the text)
    regex: str | None = None
    json_schema: str | None = None
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
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        elif self.stop is not None:
            object.__setattr__(self, "stop", tuple(self.stop))
        if self.stop_token_ids is not None:
            object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        if isinstance(self.json_schema, dict):
            object.__setattr__(self, "json_schema", json.dumps(self.json_schema))
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
        if self.n is not None and (not isinstance(self.n, int) or isinstance(self.n, bool) or self.n < 1):
            raise ValueError(f"gen.n: must be a positive integer (got {self.n!r})")

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
