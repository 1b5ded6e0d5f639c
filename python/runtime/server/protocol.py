"""Request bodies of the OpenAI-compatible API (the native API's are in native_protocol.py).

Every field of the OpenAI spec (and the extra-body fields SGLang accepts on /v1) is accepted, so that a
client written for either works unchanged; values are strict: a wrong type is a 400 (no coercion of
"10" to 10, no NaN or infinity). A field that changes nothing here is listed in NO_EFFECT (it is logged
at debug level when given); a field naming a feature radixgen lacks is accepted only when empty
(null / false / []), and otherwise refused with a 400 that names the feature. Unknown fields are 400."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from radixgen.common.lora_names import check_lora_name, pick_lora_name
from radixgen.runtime.server.declared_fields import declared_body, declared_check

INT64_MAX = 2**63 - 1

# field -> why it changes nothing here (logged at debug level when a request sets it)
NO_EFFECT = {
    "store": "no completions are stored",
    "metadata": "only for stored completions",
    "service_tier": "one tier",
    "user": "an end-user id for the caller's own logs",
    "safety_identifier": "an end-user id for the caller's own logs",
    "prompt_cache_key": "prefix caching is automatic (cache_salt partitions it)",
    "prediction": "no predicted-output speculation; the output is the same without it",
    "modalities": "text only",
}


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)


def _refuse_if_set(req: BaseModel, features: dict[str, str]) -> None:
    """`features`: field -> the missing feature it asks for; a set (truthy) value is a 400."""
    for name, feature in features.items():
        if getattr(req, name):
            raise ValueError(f"{name}: {feature} is not supported by this server (only null/false/empty)")


# ---------------------------------------------------------------- OpenAI API


class StreamOptions(_Strict):
    include_usage: bool = False
    continuous_usage_stats: bool = False
    include_obfuscation: bool = False  # no effect: no padding is added to chunks


# ---- the declared sampling parameters on the OpenAI bodies (radixgen.common.sampling_params)
# The OpenAI body's name of a declared parameter where it differs.
OPENAI_NAMES = {"min_new_tokens": "min_tokens"}
# Declared parameters the OpenAI API does not take (the native /generate does).
OPENAI_NOT_EXPOSED = frozenset(("stop_regex", "choices"))
# Declared parameters the chat path sets itself (chat_constraint.py: max_thinking_tokens, a chat field, with the
# reasoning format's closing text); a completion has no think block.
SET_BY_CHAT = frozenset(("max_thinking_tokens", "think_end"))
# The OpenAI API's own defaults and bounds where they differ from the declared ones: one choice unless asked,
# temperature in [0, 2], at most 64 choices, a seed that fits in 64 bits.
OPENAI_DEFAULTS = {"n": 1}
OPENAI_LIMITS: dict[str, dict[str, Any]] = {
    "temperature": {"ge": 0.0, "le": 2.0},
    "n": {"ge": 1, "le": 64},
    "seed": {"ge": -INT64_MAX - 1, "le": INT64_MAX},
}


class _SamplingBody(_Strict):
    """What /v1/completions and /v1/chat/completions share beside the declared parameters (OpenAI's fields and
    the usual extra-body ones); SamplingFields adds the declared parameters."""

    model: str | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    cache_salt: str | None = Field(None, max_length=256)  # prefixes are shared only with the same salt
    # no effect (NO_EFFECT)
    user: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    store: bool | None = None
    metadata: dict[str, str] | None = None
    service_tier: Literal["auto", "default", "flex", "scale", "priority"] | None = None
    # SGLang's extra body
    rid: str | None = None
    lora_name: str | list[str | None] | None = None  # a loaded LoRA adapter (as `model` may name it)
    lora_path: str | list[str | None] | None = None  # SGLang's name of lora_name (an adapter's name, not a folder)
    session_params: dict[str, Any] | None = None
    return_hidden_states: bool = False

    @model_validator(mode="after")
    def _sampling_checks(self):
        key, name = pick_lora_name(self.lora_name, self.lora_path)
        check_lora_name(name, key, per_prompt=True)
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed when stream is true")
        if self.seed is not None and self.seed + self.n - 1 > INT64_MAX:
            raise ValueError("seed: seed + n - 1 must fit in 64 bits (choice j is sampled with seed + j)")
        _refuse_if_set(
            self,
            {
                "session_params": "sessions",
                "return_hidden_states": "returning hidden states",
            },
        )
        return self

    def no_effect_fields(self) -> list[str]:
        return [f for f in NO_EFFECT if f in self.model_fields_set]

    @property
    def lora(self) -> tuple[str, Any]:
        """(the keyword the request named its adapter with, the adapter or one per prompt; None: none named)."""
        return pick_lora_name(self.lora_name, self.lora_path)


# Every declared parameter the OpenAI API exposes, under its OPENAI_NAMES spelling; the token budget is each
# body's own (max_tokens / max_completion_tokens).
SamplingFields = declared_body(
    "SamplingFields", _SamplingBody, spelling=OPENAI_NAMES, defaults=OPENAI_DEFAULTS, limits=OPENAI_LIMITS,
    exclude=OPENAI_NOT_EXPOSED | SET_BY_CHAT | {"max_new_tokens"},
    doc="Fields shared by /v1/completions and /v1/chat/completions (OpenAI + the usual extra-body fields + every "
        "declared sampling parameter the OpenAI API exposes).")


class CompletionRequest(SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = Field(16, ge=0)
    logprobs: int | None = Field(None, ge=0, le=20)
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None

    @model_validator(mode="after")
    def _completion_checks(self) -> CompletionRequest:
        if self.suffix:
            raise ValueError("suffix is not supported")
        if self.best_of is not None and self.best_of != self.n:
            raise ValueError("best_of is not supported (it must equal n when given)")
        if isinstance(self.prompt, list) and not self.prompt:
            raise ValueError("prompt must not be empty")
        return self


class FunctionDef(_Strict):
    name: str = Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(_Strict):
    type: Literal["function"] = "function"
    function: FunctionDef


class NamedToolChoiceFunction(_Strict):
    name: str


class NamedToolChoice(_Strict):
    type: Literal["function"] = "function"
    function: NamedToolChoiceFunction


class ToolCallFunction(BaseModel):
    name: str
    arguments: str


class ToolCall(BaseModel):
    id: str | None = None
    type: Literal["function"] = "function"
    function: ToolCallFunction


class ChatMessage(BaseModel):
    # extra fields (e.g. "refusal", "audio" echoed back by clients) are tolerated on messages: they
    # are history, not instructions to the sampler.
    model_config = ConfigDict(strict=True)

    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None
    function_call: ToolCallFunction | None = None  # the legacy form of one tool call
    reasoning_content: str | None = None  # an assistant's thinking, echoed back (harmony keeps an open turn's)


class JsonSchemaFormat(_Strict):
    name: str = "response"
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_given(self) -> ResponseFormat:
        if self.type == "json_schema" and (self.json_schema is None or self.json_schema.schema_ is None):
            raise ValueError("response_format.json_schema.schema is required for type json_schema")
        return self


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=0)
    max_completion_tokens: int | None = Field(None, ge=0)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    response_format: ResponseFormat | None = None
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True
    functions: list[FunctionDef] | None = None  # the legacy form of tools
    function_call: Literal["none", "auto"] | NamedToolChoiceFunction | None = None
    # passed to the chat template
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high"] | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    continue_final_message: bool = False
    # no effect, or refused when set
    modalities: list[Literal["text"]] | None = None
    prediction: dict[str, Any] | None = None
    audio: dict[str, Any] | None = None
    web_search_options: dict[str, Any] | None = None
    # ---- reasoning models (issue 29; SGLang's extra body): the think block of the output, see server/parsers
    separate_reasoning: bool = True  # thinking goes to reasoning_content (with a reasoning format), not content
    stream_reasoning: bool = True  # streamed as it comes; false: in one delta once the block ends
    max_thinking_tokens: int | None = None  # the think block is closed after this many tokens (range: declared)
    # ---- end of issue 29's fields

    _thinking_budget = declared_check("max_thinking_tokens")

    @model_validator(mode="before")
    @classmethod
    def _legacy_functions(cls, data: Any) -> Any:
        """`functions` / `function_call` are the legacy spelling of `tools` / `tool_choice`."""
        if not isinstance(data, dict) or ("functions" not in data and "function_call" not in data):
            return data
        if data.get("tools") is not None or data.get("tool_choice") is not None:
            raise ValueError("give either tools/tool_choice or the legacy functions/function_call, not both")
        return data

    @model_validator(mode="after")
    def _chat_checks(self) -> ChatCompletionRequest:
        _refuse_if_set(self, {"audio": "audio output", "web_search_options": "web search"})
        if self.functions is not None:
            self.tools = [Tool(function=f) for f in self.functions]
        if isinstance(self.function_call, NamedToolChoiceFunction):
            self.tool_choice = NamedToolChoice(function=self.function_call)
        elif self.function_call is not None:
            self.tool_choice = self.function_call
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs requires logprobs to be true")
        if self.tool_choice not in (None, "none", "auto") and not self.tools:
            raise ValueError("tool_choice requires tools")
        if isinstance(self.tool_choice, NamedToolChoice):
            names = [t.function.name for t in self.tools or []]
            if self.tool_choice.function.name not in names:
                raise ValueError(
                    f"tool_choice names function {self.tool_choice.function.name!r}, not in tools"
                )
        if self.continue_final_message and self.messages[-1].role != "assistant":
            raise ValueError("continue_final_message requires the last message to be from the assistant")
        return self

    @property
    def legacy_functions(self) -> bool:
        """Answer in the legacy `function_call` message shape."""
        return self.functions is not None

    @property
    def effective_tool_choice(self) -> str | NamedToolChoice:
        """OpenAI's default: "auto" when tools are given, else "none"."""
        if self.tool_choice is None:
            return "auto" if self.tools else "none"
        return self.tool_choice

    @property
    def parallel_calls(self) -> bool:
        return self.parallel_tool_calls and not self.legacy_functions  # the legacy form has one call

    def template_kwargs(self) -> dict[str, Any]:
        """Extra variables for the chat template."""
        kwargs = dict(self.chat_template_kwargs or {})
        if self.reasoning_effort is not None:
            kwargs.setdefault("reasoning_effort", self.reasoning_effort)
        return kwargs
