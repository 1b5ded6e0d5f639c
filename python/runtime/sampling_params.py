"""Per-request sampling parameters, validated before anything is queued."""

from __future__ import annotations

import json
import re
from dataclasses import asdict, dataclass, field, fields
from typing import Any

# Constraint fields: a request carries at most one of them.
CONSTRAINT_FIELDS = ("regex", "json_schema", "ebnf", "choices")


@dataclass
class SamplingParams:
    max_new_tokens: int = 128
    min_new_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1 or 0: the whole vocabulary
    min_p: float = 0.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    stop_regex: str | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    no_stop_trim: bool = False
    seed: int | None = None
    n: int = 1
    regex: str | None = None
    json_schema: str | None = None  # a dict is serialized on construction
    ebnf: str | None = None
    choices: list[str] | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if isinstance(self.json_schema, dict):
            self.json_schema = json.dumps(self.json_schema)
        if self.top_k == 0:
            self.top_k = -1
        self.validate()

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
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"sampling_params: unknown field(s) {unknown}")
        try:
            return cls(**d)
        except TypeError as e:  # pragma: no cover - dataclass signature errors
            raise ValueError(f"sampling_params: {e}") from e

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1

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

    def validate(self) -> None:
        def bad(name: str, why: str) -> None:
            raise ValueError(f"sampling_params.{name}: {why} (got {getattr(self, name)!r})")

        def is_int(x: Any) -> bool:
            return isinstance(x, int) and not isinstance(x, bool)

        def is_num(x: Any) -> bool:
            return isinstance(x, (int, float)) and not isinstance(x, bool)

        if not is_int(self.max_new_tokens) or self.max_new_tokens < 0:
            bad("max_new_tokens", "must be an integer >= 0")
        if not is_int(self.min_new_tokens) or self.min_new_tokens < 0:
            bad("min_new_tokens", "must be an integer >= 0")
        if self.min_new_tokens > self.max_new_tokens:
            bad("min_new_tokens", f"must not exceed max_new_tokens={self.max_new_tokens}")
        if not is_num(self.temperature) or not 0.0 <= self.temperature <= 100.0:
            bad("temperature", "must be in [0, 100]")
        if not is_num(self.top_p) or not 0.0 < self.top_p <= 1.0:
            bad("top_p", "must be in (0, 1]")
        if not is_int(self.top_k) or (self.top_k < 1 and self.top_k != -1):
            bad("top_k", "must be -1 (disabled) or a positive integer")
        if not is_num(self.min_p) or not 0.0 <= self.min_p <= 1.0:
            bad("min_p", "must be in [0, 1]")
        for name in ("frequency_penalty", "presence_penalty"):
            v = getattr(self, name)
            if not is_num(v) or not -2.0 <= v <= 2.0:
                bad(name, "must be in [-2, 2]")
        if not is_num(self.repetition_penalty) or not 0.0 < self.repetition_penalty <= 2.0:
            bad("repetition_penalty", "must be in (0, 2]")
        if not all(isinstance(s, str) and s for s in self.stop):
            bad("stop", "must be a non-empty string or a list of non-empty strings")
        if not all(is_int(t) and t >= 0 for t in self.stop_token_ids):
            bad("stop_token_ids", "must be a list of non-negative integers")
        if self.stop_regex is not None:
            try:
                re.compile(self.stop_regex)
            except (re.error, TypeError) as e:
                bad("stop_regex", f"is not a valid regular expression: {e}")
        if self.seed is not None and not is_int(self.seed):
            bad("seed", "must be an integer")
        if not is_int(self.n) or self.n < 1:
            bad("n", "must be a positive integer")
        set_constraints = [n for n in CONSTRAINT_FIELDS if getattr(self, n) is not None]
        if len(set_constraints) > 1:
            raise ValueError(
                f"sampling_params: at most one of {list(CONSTRAINT_FIELDS)} may be set, got {set_constraints}"
            )
        for name in ("regex", "ebnf", "json_schema"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, str) or not v):
                bad(name, "must be a non-empty string")
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
