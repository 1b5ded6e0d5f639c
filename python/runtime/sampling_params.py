"""Per-request sampling parameters, validated before anything is queued.

Types are strict: an int field takes an int (never a bool, a float or a numeric string), a float field an int
or a float (never a bool), a flag a bool. A bad value is a ValueError that names the field
("sampling_params.<field>: ..."), which the server answers with 400.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import asdict, dataclass, field, fields
from typing import Any

from radixgen.runtime.stop_regex import stop_regex_patterns

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
CONSTRAINT_FIELDS = ("regex", "json_schema", "ebnf", "choices")
_BOOL_FIELDS = ("ignore_eos", "skip_special_tokens", "no_stop_trim")


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


@dataclass
class SamplingParams:
    max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS
    min_new_tokens: int = 0
    temperature: float = 1.0  # below MIN_SAMPLING_TEMPERATURE: greedy
    top_p: float = 1.0
    top_k: int = -1  # -1 or 0: the whole vocabulary
    min_p: float = 0.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    stop_regex: str | list[str] | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    no_stop_trim: bool = False
    seed: int | None = None
    n: int = 1
    regex: str | None = None
    json_schema: str | None = None  # a dict is serialized on construction
    ebnf: str | None = None
    choices: list[str] | None = None
    # token id -> added to its logit before sampling (OpenAI's logit_bias; string keys as JSON sends them are
    # converted); -100 bans a token, +100 all but forces it
    logit_bias: dict[int, float] | None = None
    # ---- reasoning models (issue 29): a thinking budget. The output begins inside a think block; when
    # `think_end` (the block's closing text) is not in the first `max_thinking_tokens` output tokens, its
    # tokens are forced there, and the answer (and its grammar's part after the block) follows.
    max_thinking_tokens: int | None = None
    think_end: str | None = None
    # ---- end of issue 29's fields

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
        if isinstance(self.json_schema, dict):
            self.json_schema = json.dumps(self.json_schema)
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
    def constraint(self) -> tuple[str, str] | None:
        """(kind, text) of the grammar constraint, or None."""
        for name in CONSTRAINT_FIELDS:
            value = getattr(self, name)
            if value is not None:
                if name == "choices":
                    return ("choices", json.dumps(value))
                return (name, value)
        return None

    def _bad(self, name: str, why: str) -> None:
        raise ValueError(f"sampling_params.{name}: {why} (got {getattr(self, name)!r})")

    def _check_range(self, name: str, low: float, high: float, low_open: bool = False) -> None:
        v = getattr(self, name)
        inside = is_number(v) and math.isfinite(v) and (low < v if low_open else low <= v) and v <= high
        if not inside:
            self._bad(name, f"must be a finite number in {'(' if low_open else '['}{low:g}, {high:g}]")

    def validate(self) -> None:
        bad = self._bad
        if not is_int(self.max_new_tokens) or self.max_new_tokens < 0:
            bad("max_new_tokens", "must be an integer >= 0")
        if not is_int(self.min_new_tokens) or self.min_new_tokens < 0:
            bad("min_new_tokens", "must be an integer >= 0")
        if self.min_new_tokens > self.max_new_tokens:
            bad("min_new_tokens", f"must not exceed max_new_tokens={self.max_new_tokens}")
        self._check_range("temperature", 0.0, MAX_TEMPERATURE)
        self._check_range("top_p", 0.0, 1.0, low_open=True)
        if not is_int(self.top_k) or (self.top_k < 1 and self.top_k not in (-1, 0)):
            bad("top_k", "must be -1 or 0 (disabled) or a positive integer")
        self._check_range("min_p", 0.0, 1.0)
        self._check_range("frequency_penalty", -2.0, 2.0)
        self._check_range("presence_penalty", -2.0, 2.0)
        self._check_range("repetition_penalty", MIN_REPETITION_PENALTY, MAX_REPETITION_PENALTY)
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
        for name in _BOOL_FIELDS:
            if not isinstance(getattr(self, name), bool):
                bad(name, "must be a boolean")
        if self.seed is not None and (not is_int(self.seed) or not MIN_SEED <= self.seed <= MAX_SEED):
            bad("seed", f"must be an integer in [{MIN_SEED}, {MAX_SEED}]")
        if not is_int(self.n) or not 1 <= self.n <= MAX_N:
            bad("n", f"must be an integer in [1, {MAX_N}]")
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
        if self.max_thinking_tokens is not None:
            if not is_int(self.max_thinking_tokens) or self.max_thinking_tokens < 0:
                self._bad("max_thinking_tokens", "must be an integer >= 0")
            if not isinstance(self.think_end, str) or not self.think_end:
                self._bad("think_end", "max_thinking_tokens needs the think block's closing text (e.g. '</think>')")
        elif self.think_end is not None:
            self._bad("think_end", "is only used with max_thinking_tokens")
        if self.think_end is not None:
            check_text("sampling_params.think_end", self.think_end)

    def _validate_constraint(self) -> None:
        bad = self._bad
        set_constraints = [n for n in CONSTRAINT_FIELDS if getattr(self, n) is not None]
        if len(set_constraints) > 1:
            raise ValueError(
                f"sampling_params: at most one of {list(CONSTRAINT_FIELDS)} may be set, got {set_constraints}"
            )
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
