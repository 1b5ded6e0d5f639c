"""Per-request sampling parameters, declared once and validated before anything is queued.

`SamplingParams` is the one declaration every front end is built from (the language's `gen(...)`, its typed
gens and `run` / `arun` / `run_batch`, the native and OpenAI bodies, the offline API): each field is a
`param(default, help=..., lo=..., hi=...)` whose metadata carries its range, help text and, where JSON carries
it in another shape, its wire type; `check_param` checks one value against that metadata and is the only
range check (the bodies call it per field, `validate()` for every field). Adding a parameter is one `param(...)`
here: every surface takes it under its own spelling (an API's name map) unless that surface lists it as not
exposed (tests/common/test_sampling_contract.py shows a new field reaching every surface).

Types are strict: an int field takes an int (never a bool, a float or a numeric string), a float field an int
or a float (never a bool), a flag a bool. A bad value is a ValueError that names the field
("sampling_params.<field>: ..."), which the server answers with 400.
"""

from __future__ import annotations

import json
import math
import re
import typing
from dataclasses import MISSING, Field, asdict, dataclass, field, fields
from typing import Any

from radixgen.common.constraint import (
    CONSTRAINT_KINDS,
    Constraint,
    TooManyConstraints,
    constraint_text,
    normalize_constraint,
)
from radixgen.common.stop_regex import stop_regex_patterns

# The one default for every front end (Engine, server, language): how many tokens a request may generate.
DEFAULT_MAX_NEW_TOKENS = 128
# Below this temperature a request is greedy. Sampling divides logit differences by the temperature in float32:
# 1e-5 keeps that division well defined, and the distribution it gives is already argmax up to exact ties;
# a smaller value (1e-300 rounds to 0 in float32) would only turn the division into inf / NaN.
MIN_SAMPLING_TEMPERATURE = 1e-5
MAX_TEMPERATURE = 100.0
# A repetition penalty divides (or multiplies) a logit: below 0.01 a large logit overflows float32.
MIN_REPETITION_PENALTY = 0.01
MAX_REPETITION_PENALTY = 2.0
# Seeds are whatever torch.Generator.manual_seed takes: a signed or unsigned 64-bit integer.
MIN_SEED = -(2**63)
MAX_SEED = 2**64 - 1
MAX_N = 128  # choices per request, as the OpenAI API caps it
MAX_LOGIT_BIAS = 100.0  # as the OpenAI API bounds each logit_bias value

# Constraint fields: a request carries at most one of them.
CONSTRAINT_FIELDS = CONSTRAINT_KINDS


def param(default: Any = MISSING, *, help: str, kind: type | None = None, lo: float | None = None,  # noqa: A002
          hi: float | None = None, lo_open: bool = False, optional: bool = False,
          factory: Any = MISSING, wire: Any = None) -> Any:
    """One declared sampling parameter: a dataclass field whose metadata holds its help text and, for a plain
    int / float / bool (`kind`), the range `check_param` checks ([lo, hi], or (lo, hi] with lo_open; None:
    unbounded). `optional`: None is accepted too. Fields without `kind` have their own check in validate().
    `wire`: the type a JSON body carries it as, where that differs from the field's own (None: the same)."""
    meta = {"help": help, "kind": kind, "lo": lo, "hi": hi, "lo_open": lo_open, "optional": optional, "wire": wire}
    if factory is not MISSING:
        return field(default_factory=factory, metadata=meta)
    return field(default=default, metadata=meta)


def is_int(x: Any) -> bool:
    """An int that is not a bool (bool is a subclass of int)."""
    return isinstance(x, int) and not isinstance(x, bool)


def is_number(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def check_text(name: str, text: str) -> None:
    """A ValueError naming `name` when `text` cannot be encoded as UTF-8 (a lone surrogate such as '\\ud800',
    which JSON can carry but no tokenizer or detokenizer can)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(f"{name}: invalid text: lone surrogate {text[e.start]!r} at character {e.start} "
                         f"(not valid Unicode)") from None


def _token_key(key: Any) -> int:
    """A logit_bias key: an int, or a string of one (JSON object keys are strings)."""
    if is_int(key):
        return key
    if isinstance(key, str) and re.fullmatch(r"-?[0-9]{1,12}", key):
        return int(key)
    raise ValueError(f"sampling_params.logit_bias: keys must be token ids (integers), got {key!r}")


def choice_seeds(seed: int | None, n: int) -> list[int | None]:
    """The seeds of the `n` choices of one request: choice k samples with seed + k (distinct, reproducible).
    Every one must be a valid seed, so a seed near the top of the range with n > 1 is an error here, not a
    crash of the scheduler when it seeds the generator."""
    if not is_int(n) or n < 1:
        raise ValueError(f"sampling_params.n: must be a positive integer (got {n!r})")
    if seed is None:
        return [None] * n
    if not is_int(seed) or not MIN_SEED <= seed <= MAX_SEED:
        raise ValueError(f"sampling_params.seed: must be an integer in [{MIN_SEED}, {MAX_SEED}] (got {seed!r})")
    if seed + n - 1 > MAX_SEED:
        raise ValueError(f"sampling_params.seed: with n={n} the choices use seeds {seed}..{seed + n - 1}, "
                         f"past the largest seed {MAX_SEED}")
    return [seed + k for k in range(n)]


def _range_error(f: Field, value: Any) -> str | None:
    """Why `value` breaks the declared kind / range of field `f` (None: it does not)."""
    m = f.metadata
    kind, lo, hi = m["kind"], m["lo"], m["hi"]
    if value is None and m["optional"]:
        return None
    if kind is bool:
        return None if isinstance(value, bool) else "must be a boolean"
    if kind is int:
        inside = is_int(value) and (lo is None or value >= lo) and (hi is None or value <= hi)
        if inside:
            return None
        return f"must be an integer >= {lo}" if hi is None else f"must be an integer in [{lo}, {hi}]"
    inside = (is_number(value) and math.isfinite(value) and (lo < value if m["lo_open"] else lo <= value)
              and value <= hi)
    return None if inside else f"must be a finite number in {'(' if m['lo_open'] else '['}{lo:g}, {hi:g}]"


@dataclass
class SamplingParams:
    max_new_tokens: int = param(DEFAULT_MAX_NEW_TOKENS, kind=int, lo=0, help="the most tokens to generate")
    min_new_tokens: int = param(0, kind=int, lo=0,
                                help="stop conditions (EOS, stop strings) apply only after this many")
    temperature: float = param(1.0, kind=float, lo=0.0, hi=MAX_TEMPERATURE,
                               help="softmax temperature; below MIN_SAMPLING_TEMPERATURE: greedy")
    top_p: float = param(1.0, kind=float, lo=0.0, hi=1.0, lo_open=True, help="nucleus sampling mass")
    top_k: int = param(-1, help="sample among the k likeliest tokens; -1 or 0: the whole vocabulary")
    min_p: float = param(0.0, kind=float, lo=0.0, hi=1.0, help="drop tokens below min_p times the top probability")
    frequency_penalty: float = param(0.0, kind=float, lo=-2.0, hi=2.0,
                                     help="subtracted from a logit once per earlier occurrence in the output")
    presence_penalty: float = param(0.0, kind=float, lo=-2.0, hi=2.0,
                                    help="subtracted from the logit of every token already in the output")
    repetition_penalty: float = param(1.0, kind=float, lo=MIN_REPETITION_PENALTY, hi=MAX_REPETITION_PENALTY,
                                      help="divides positive (multiplies negative) logits of seen tokens")
    stop: list[str] = param(factory=list, wire=str | list[str] | None,
                            help="stop strings (not part of the output unless no_stop_trim)")
    stop_token_ids: list[int] = param(factory=list, help="token ids that end the output")
    stop_regex: str | list[str] | None = param(None, help="regexes that end the output where a match ends")
    ignore_eos: bool = param(False, kind=bool, help="keep generating past the end-of-sequence token")
    skip_special_tokens: bool = param(True, kind=bool, help="leave special tokens out of the output text")
    no_stop_trim: bool = param(False, kind=bool, help="keep the matched stop string in the output")
    seed: int | None = param(None, kind=int, lo=MIN_SEED, hi=MAX_SEED, optional=True,
                             help="seed of this request's sampling (choice k of n uses seed + k)")
    n: int = param(1, kind=int, lo=1, hi=MAX_N, help="independent choices for the same prompt")
    regex: str | None = param(None, help="constraint: the output matches this regular expression")
    json_schema: str | None = param(None, wire=str | dict[str, Any] | None,
                                    help="constraint: the output is JSON valid for this schema (a dict is "
                                         "serialized on construction)")
    ebnf: str | None = param(None, help="constraint: the output derives from this grammar's root rule")
    choices: list[str] | None = param(None, help="constraint: the output is exactly one of these strings")
    # OpenAI's logit_bias; string keys as JSON sends them are converted; -100 bans a token, +100 all but forces it
    logit_bias: dict[int, float] | None = param(None, wire=dict[str, float] | None,
                                                help="token id -> added to its logit before sampling")
    # ---- reasoning models: a thinking budget. The output begins inside a think block; when `think_end` (the
    # block's closing text) is not in the first `max_thinking_tokens` output tokens, its tokens are forced there,
    # and the answer (and its grammar's part after the block) follows.
    max_thinking_tokens: int | None = param(None, kind=int, lo=0, optional=True,
                                            help="the most tokens of the think block before it is closed")
    think_end: str | None = param(None, help="the think block's closing text (with max_thinking_tokens)")

    def __post_init__(self) -> None:
        # shapes first (a str stop is one stop string, a dict schema is serialized), then every value
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        elif self.stop is None:
            self.stop = []
        elif not isinstance(self.stop, (list, tuple)):
            self._bad("stop", "must be a string or a list of strings")
        self.stop = list(self.stop)
        if self.stop_token_ids is None:
            self.stop_token_ids = []
        elif not isinstance(self.stop_token_ids, (list, tuple)):
            self._bad("stop_token_ids", "must be a list of integers")
        self.stop_token_ids = list(self.stop_token_ids)
        self.json_schema = constraint_text("json_schema", self.json_schema)
        if isinstance(self.logit_bias, dict):
            self.logit_bias = {_token_key(k): v for k, v in self.logit_bias.items()} or None
        elif self.logit_bias is not None:
            self._bad("logit_bias", "must be an object mapping token ids to numbers")
        self.validate()
        if self.top_k == 0:
            self.top_k = -1

    @classmethod
    def from_dict(cls, d: dict[str, Any] | SamplingParams | None) -> SamplingParams:
        """Build from a user dict; an unknown key is an error, never silently ignored."""
        if d is None:
            return cls()
        if isinstance(d, SamplingParams):
            return d
        if not isinstance(d, dict):
            raise ValueError(f"sampling_params must be a dict, got {type(d).__name__}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(d) - known, key=str)
        if unknown:
            raise ValueError(f"sampling_params: unknown field(s) {unknown}")
        return cls(**d)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @property
    def greedy(self) -> bool:
        return self.temperature < MIN_SAMPLING_TEMPERATURE or self.top_k == 1

    @property
    def constraint(self) -> Constraint | None:
        """The grammar constraint (kind, text), or None: the front check's input and the compile cache's key."""
        return normalize_constraint({name: getattr(self, name) for name in CONSTRAINT_FIELDS})

    def _bad(self, name: str, why: str) -> None:
        raise ValueError(f"sampling_params.{name}: {why} (got {getattr(self, name)!r})")

    def validate(self) -> None:
        bad = self._bad
        for f in fields(self):  # the declared kinds and ranges
            check_param(f.name, getattr(self, f.name))
        if self.min_new_tokens > self.max_new_tokens:
            bad("min_new_tokens", f"must not exceed max_new_tokens={self.max_new_tokens}")
        if not is_int(self.top_k) or (self.top_k < 1 and self.top_k not in (-1, 0)):
            bad("top_k", "must be -1 or 0 (disabled) or a positive integer")
        for tok, bias in (self.logit_bias or {}).items():
            if tok < 0:
                bad("logit_bias", f"token ids must be >= 0, got {tok}")
            if not (is_number(bias) and math.isfinite(bias) and -MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS):
                bad("logit_bias", f"the bias of token {tok} must be a finite number in [-100, 100], got {bias!r}")
        if not all(isinstance(s, str) and s for s in self.stop):
            bad("stop", "must be a non-empty string or a list of non-empty strings")
        for s in self.stop:
            check_text("sampling_params.stop", s)
        if not all(is_int(t) and t >= 0 for t in self.stop_token_ids):
            bad("stop_token_ids", "must be a list of non-negative integers")
        choice_seeds(self.seed, self.n)
        if self.stop_regex is not None:  # a string or a list of strings (any of them matching stops)
            regexes = [self.stop_regex] if isinstance(self.stop_regex, str) else self.stop_regex
            if not isinstance(regexes, list) or not regexes or not all(isinstance(r, str) and r for r in regexes):
                bad("stop_regex", "must be a non-empty string or a non-empty list of them")
            for r in regexes:
                check_text("sampling_params.stop_regex", r)
            try:  # the scheduler matches it with an automaton (linear time): it must compile to one
                stop_regex_patterns(regexes)
            except (ValueError, RecursionError, OverflowError) as e:
                bad("stop_regex", str(e))
        self._validate_constraint()
        self._validate_thinking()

    def _validate_thinking(self) -> None:
        if self.max_thinking_tokens is not None:  # its range: the declaration's (validate)
            if not isinstance(self.think_end, str) or not self.think_end:
                self._bad("think_end", "max_thinking_tokens needs the think block's closing text (e.g. '</think>')")
        elif self.think_end is not None:
            self._bad("think_end", "is only used with max_thinking_tokens")
        if self.think_end is not None:
            check_text("sampling_params.think_end", self.think_end)

    def _validate_constraint(self) -> None:
        bad = self._bad
        try:
            normalize_constraint({name: getattr(self, name) for name in CONSTRAINT_FIELDS})
        except TooManyConstraints as e:
            raise ValueError(f"sampling_params: at most one of {list(CONSTRAINT_FIELDS)} may be set, "
                             f"got {e.given}") from None
        for name in ("regex", "ebnf", "json_schema"):
            v = getattr(self, name)
            if v is not None:
                if not isinstance(v, str) or not v:
                    bad(name, "must be a non-empty string")
                check_text(f"sampling_params.{name}", v)
        if self.json_schema is not None:
            try:
                json.loads(self.json_schema)
            except ValueError as e:
                bad("json_schema", f"is not valid JSON: {e}")
        if self.choices is not None:
            if not isinstance(self.choices, list) or not self.choices:
                bad("choices", "must be a non-empty list of strings")
            if not all(isinstance(c, str) and c for c in self.choices):
                bad("choices", "must be a non-empty list of non-empty strings")
            for c in self.choices:
                check_text("sampling_params.choices", c)


def sampling_fields() -> tuple[Field, ...]:
    """The declared parameters, in order (name, default, metadata["help"], ...)."""
    return fields(SamplingParams)


def default_of(name: str) -> Any:
    """The declared default of one parameter (a fresh list for list-valued ones)."""
    f = SamplingParams.__dataclass_fields__[name]
    return f.default_factory() if f.default is MISSING else f.default


def declared(name: str) -> Field:
    """The declaration of one parameter (KeyError: not a declared parameter)."""
    return SamplingParams.__dataclass_fields__[name]


def param_error(name: str, value: Any) -> str | None:
    """Why `value` breaks parameter `name`'s declared kind and range (None: it does not, or the parameter has
    its own check in validate()). The one range check: every surface calls it (through check_param)."""
    f = declared(name)
    return None if f.metadata["kind"] is None else _range_error(f, value)


def check_param(name: str, value: Any, where: str = "sampling_params") -> None:
    """A ValueError "<where>.<name>: <why> (got <value>)" when `value` breaks the declared kind and range."""
    why = param_error(name, value)
    if why is not None:
        raise ValueError(f"{where}.{name}: {why} (got {value!r})")


def param_type(name: str) -> Any:
    """The declared Python type of a parameter (its resolved annotation)."""
    return typing.get_type_hints(SamplingParams)[name]


def wire_type(name: str) -> Any:
    """The type a JSON body carries the parameter as (its declared type unless the declaration says `wire`)."""
    wire = declared(name).metadata["wire"]
    return param_type(name) if wire is None else wire
