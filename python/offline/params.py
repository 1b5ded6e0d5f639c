"""vLLM-shaped request parameters for `radixgen.LLM`: `SamplingParams` and `GuidedDecodingParams`.

These are the offline API's own classes (vLLM's names and defaults, e.g. max_tokens=16); the
runtime's native `radixgen.SamplingParams` (max_new_tokens...) is a different class, and
`LLM.generate` takes either (or a dict of native fields). Each maps onto the native parameters in
`native()`; a vLLM option radixgen has no implementation for is refused when set, never ignored.
"""

from __future__ import annotations

from dataclasses import dataclass, field, make_dataclass
from typing import Any

from radixgen.common.constraint import constraint_text
from radixgen.common.sampling_params import CONSTRAINT_FIELDS, default_of, param_type, sampling_fields

# vLLM's name of a declared sampling parameter where it differs (radixgen.common.sampling_params)
OFFLINE_NAMES = {"max_new_tokens": "max_tokens", "min_new_tokens": "min_tokens",
                 "no_stop_trim": "include_stop_str_in_output"}
# Declared parameters vLLM's SamplingParams has no field for (the native dict LLM.generate takes has them).
# The constraints come from guided_decoding / structured_outputs.
OFFLINE_NOT_EXPOSED = frozenset(("stop_regex", "max_thinking_tokens", "think_end"))


@dataclass
class GuidedDecodingParams:
    """Structured output: exactly one of json (a JSON schema: dict, str or pydantic model class),
    regex, choice (a list of strings), grammar (EBNF, xgrammar's dialect), json_object=True."""

    json: dict | str | type | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    backend: str | None = None
    whitespace_pattern: str | None = None

    def __post_init__(self) -> None:
        kinds = ("json", "regex", "choice", "grammar", "json_object")
        given = [k for k in kinds if getattr(self, k) not in (None, False)]
        if len(given) != 1:
            raise ValueError(f"GuidedDecodingParams: set exactly one of {', '.join(kinds)} (got {given})")
        if self.backend not in (None, "auto", "xgrammar"):
            raise ValueError(f"GuidedDecodingParams.backend: radixgen uses xgrammar only (got {self.backend!r})")
        if self.whitespace_pattern is not None:
            raise ValueError(
                "GuidedDecodingParams.whitespace_pattern: not supported (the Engine option grammar_json_whitespace "
                "chooses compact or flexible JSON)"
            )
        if self.choice is not None and (isinstance(self.choice, str) or not list(self.choice)):
            raise ValueError("GuidedDecodingParams.choice: must be a non-empty list of strings")

    def native(self) -> dict[str, Any]:
        if self.json is not None:
            schema = self.json
            if isinstance(schema, type) and hasattr(schema, "model_json_schema"):  # a pydantic model
                schema = schema.model_json_schema()
            return {"json_schema": constraint_text("json_schema", schema)}
        if self.json_object:
            return {"json_schema": constraint_text("json_schema", {"type": "object"})}
        if self.regex is not None:
            return {"regex": self.regex}
        if self.choice is not None:
            return {"choices": list(self.choice)}
        return {"ebnf": self.grammar}


# vLLM options with no implementation here: refused unless left at these defaults.
_UNSUPPORTED = {
    "best_of": None,
    "allowed_token_ids": None,
    "bad_words": None,
    "logits_processors": None,
    "detokenize": True,
}


# vLLM's defaults where they differ from the declared ones (16 new tokens; top_k 0 is the whole vocabulary).
OFFLINE_DEFAULTS = {"max_new_tokens": 16, "top_k": 0}
# vLLM's own options (not declared sampling parameters): (name, type, default).
_VLLM_OWN: list[tuple[str, Any, Any]] = [
    ("logprobs", int | None, None),  # top logprobs per output token (0: the sampled token's only)
    ("prompt_logprobs", int | None, None),  # top logprobs per prompt token
    ("spaces_between_special_tokens", bool, True),
    ("truncate_prompt_tokens", int | None, None),  # keep only the prompt's last k tokens
    ("guided_decoding", GuidedDecodingParams | dict | None, None),
    ("structured_outputs", GuidedDecodingParams | dict | None, None),  # vLLM's newer name for guided_decoding
    ("best_of", int | None, None),
    ("allowed_token_ids", list[int] | None, None),
    ("bad_words", list[str] | None, None),
    ("logits_processors", list | None, None),
    ("detokenize", bool, True),
    ("extra_args", dict, field(default_factory=dict)),
]


def _offline_fields() -> list[tuple[str, Any, Any]]:
    """A field per declared parameter vLLM's SamplingParams has (under its vLLM name; a list default is None,
    as vLLM's), then vLLM's own options."""
    out: list[tuple[str, Any, Any]] = []
    for f in sampling_fields():
        if f.name in CONSTRAINT_FIELDS or f.name in OFFLINE_NOT_EXPOSED:
            continue
        default = OFFLINE_DEFAULTS.get(f.name, default_of(f.name))
        annotation = param_type(f.name) | None
        out.append((OFFLINE_NAMES.get(f.name, f.name), annotation, None if isinstance(default, list) else default))
    return out + _VLLM_OWN


class _OfflineParams:
    """The behaviour of the offline SamplingParams; its fields are built from the declaration (_offline_fields)."""

    def __post_init__(self) -> None:
        for name, default in _UNSUPPORTED.items():
            value = getattr(self, name)
            if name == "best_of" and value in (None, self.n):
                continue
            if value != default:
                raise ValueError(f"SamplingParams.{name}: not supported by radixgen (got {value!r})")
        if self.extra_args:
            raise ValueError(f"SamplingParams.extra_args: radixgen takes no extra arguments (got {self.extra_args!r})")
        if self.guided_decoding is not None and self.structured_outputs is not None:
            raise ValueError("SamplingParams: set guided_decoding or structured_outputs, not both")
        guided = self.guided_decoding if self.guided_decoding is not None else self.structured_outputs
        if isinstance(guided, dict):
            guided = GuidedDecodingParams(**guided)
        if guided is not None and not isinstance(guided, GuidedDecodingParams):
            raise ValueError(f"SamplingParams.guided_decoding: a GuidedDecodingParams, not {type(guided).__name__}")
        self.guided_decoding, self.structured_outputs = guided, None
        for name in ("logprobs", "prompt_logprobs", "truncate_prompt_tokens"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 0):
                raise ValueError(f"SamplingParams.{name}: must be None or an integer >= 0 (got {value!r})")
        if self.max_tokens is not None and (not isinstance(self.max_tokens, int) or self.max_tokens < 1):
            raise ValueError(f"SamplingParams.max_tokens: must be None or an integer >= 1 (got {self.max_tokens!r})")

    @property
    def top_logprobs_num(self) -> int:
        return max(self.logprobs or 0, self.prompt_logprobs or 0)

    def native(self, prompt_len: int, context_length: int) -> dict[str, Any]:
        """The runtime's sampling_params dict (its validation names any bad value)."""
        max_new = context_length - prompt_len if self.max_tokens is None else self.max_tokens
        # vLLM's stop="" is none, its top_k=0 the whole vocabulary
        out: dict[str, Any] = {"max_new_tokens": max_new, "stop": self.stop or [],
                               "top_k": -1 if self.top_k == 0 else self.top_k}
        for f in sampling_fields():  # every other declared parameter, under its vLLM name
            if f.name not in out and f.name not in CONSTRAINT_FIELDS and f.name not in OFFLINE_NOT_EXPOSED:
                value = getattr(self, OFFLINE_NAMES.get(f.name, f.name))
                if value is not None:
                    out[f.name] = value
        if not self.spaces_between_special_tokens:  # sent only when it differs from the runtime's default
            out["spaces_between_special_tokens"] = False
        if self.guided_decoding is not None:
            out.update(self.guided_decoding.native())
        return out


SamplingParams = make_dataclass("SamplingParams", _offline_fields(), bases=(_OfflineParams,), namespace={
    "__module__": __name__, "__qualname__": "SamplingParams",
    "__doc__": "vLLM's sampling parameters (names, meanings and defaults), for `LLM.generate` / `LLM.chat`: every "
               "declared parameter (radixgen.common.sampling_params) vLLM has, under its vLLM name, and vLLM's own "
               "options."})
