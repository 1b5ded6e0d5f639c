"""Request bodies of the native API, wire-compatible with SGLang's `/generate` (its `GenerateReqInput` and
`SamplingParams`) as of sglang 0.5.23.

Every field SGLang's `/generate` takes is accepted. Three kinds:
- fields with an effect here (text, input_ids, sampling, logprobs, rid, cache salts, LoRA adapters, images,
  stream...);
- fields naming a feature radixgen lacks (video, audio, hidden states, disaggregation...): accepted only
  when empty (null / false / 0 / [] / {} / a list of those), any other value is a 400 naming the feature;
- anything else (a field no version of the protocol has) is a 400, as is a value of the wrong type:
  strict mode, no coercion (`"max_new_tokens": "10"` and `input_ids: [true]` are errors).
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, field_validator, model_validator

from radixgen.common.lora_names import check_lora_name, pick_lora_name
from radixgen.common.sampling_params import DEFAULT_MAX_NEW_TOKENS
from radixgen.runtime.server.declared_fields import declared_body


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


def is_empty(value: Any) -> bool:
    """null, false, 0, "", 0-length containers, or a list of those (a batch's per-item "nothing")."""
    if value is None or value is False or value == "" or value == {} or (type(value) is int and value == 0):
        return True
    if isinstance(value, list):
        return all(is_empty(v) for v in value)
    return False


def _reject_features(value: Any, info: ValidationInfo, features: dict[str, str]) -> Any:
    if not is_empty(value):
        raise ValueError(f"{features[info.field_name]} not supported by radixgen (send null/false/empty)")
    return value


# ---------------------------------------------------------------- sampling parameters

# SGLang sampling fields naming features radixgen lacks -> what the 400 says
_SAMPLING_FEATURES = {
    "structural_tag": "structural tags (structural_tag) are",
    "custom_params": "custom_params (parameters for a custom logit processor) are",
    "watermark": "watermarking is",
}


class _NativeSamplingBase(_Strict):
    """SGLang's `SamplingParams` fields that are not declared parameters here (features, aliases, output
    spacing); NativeSamplingParams adds every declared parameter."""

    beam_width: int | None = None
    # With skip_special_tokens false: true sets each special (added) token apart from the text around it by
    # one space, as Hugging Face's slow tokenizers decode. Unset: the tokenizer's own decoding, unchanged;
    # that is also what SGLang returns with its default (true): fast tokenizers ignore the flag.
    spaces_between_special_tokens: bool | None = None
    stream_interval: int | None = Field(None, ge=1)
    sampling_seed: int | None = None  # SGLang's other name of seed
    # features radixgen lacks: only empty values
    structural_tag: Any = None
    custom_params: Any = None
    watermark: Any = None

    @field_validator(*_SAMPLING_FEATURES)
    @classmethod
    def _features(cls, value: Any, info: ValidationInfo) -> Any:
        return _reject_features(value, info, _SAMPLING_FEATURES)

    @model_validator(mode="after")
    def _checks(self) -> _NativeSamplingBase:
        if self.beam_width not in (None, 1):
            raise ValueError("beam_width: beam search is not supported by radixgen (send null or 1)")
        if self.seed is not None and self.sampling_seed is not None and self.seed != self.sampling_seed:
            raise ValueError("seed and sampling_seed are the same parameter: give one")
        return self

    def to_engine(self, prompt_tokens: int | None, context_length: int) -> dict[str, Any]:
        """The radixgen `SamplingParams` dict (range checks happen there). `prompt_tokens` is needed only
        when max_new_tokens is None (then it is the room left in the context)."""
        d = self.model_dump(exclude_none=True, include=set(self.declared_names))
        if self.max_new_tokens is None:
            d["max_new_tokens"] = max(context_length - (prompt_tokens or 0), 0)
        if self.sampling_seed is not None:
            d["seed"] = self.sampling_seed
        for name in ("regex", "ebnf", "json_schema"):  # SGLang: an empty constraint means "unset"
            if d.get(name) in ("", {}):
                del d[name]
        if not self.stop_regex:  # SGLang's client sends [] for none
            d.pop("stop_regex", None)
        return d


# SGLang's `SamplingParams` plus radixgen's own (`seed`, `choices`, `logit_bias`, the thinking budget): every
# declared parameter, under its own name, None meaning the default (max_new_tokens: None is the room left in the
# context); values are checked by the declaration, per field.
NativeSamplingParams = declared_body(
    "NativeSamplingParams", _NativeSamplingBase, defaults={"max_new_tokens": DEFAULT_MAX_NEW_TOKENS},
    doc="The `sampling_params` of /generate: SGLang's fields and every parameter radixgen.common.sampling_params "
        "declares (tests/common/test_sampling_contract.py).")


def parse_sampling_params(value: dict | None, where: str = "sampling_params") -> NativeSamplingParams:
    """One sampling-parameter dict, with errors that name the field: `sampling_params.top_k: ...`."""
    try:
        return NativeSamplingParams.model_validate(value or {})
    except ValidationError as e:
        err = e.errors()[0]
        field = ".".join(str(x) for x in err["loc"])
        message = err["msg"].removeprefix("Value error, ")
        got = f" (got {err['input']!r})" if field and "input" in err else ""
        raise ValueError(f"{where}{'.' + field if field else ''}: {message}{got}") from None


# ---------------------------------------------------------------- /generate

# GenerateReqInput fields naming features radixgen lacks -> what the 400 says
_GENERATE_FEATURES = {
    "input_embeds": "input_embeds (prompts given as embeddings) are",
    "video_data": "video inputs (video_data) are",
    "audio_data": "audio inputs (audio_data) are",
    "mm_hashes": "multimodal inputs (mm_hashes) are",
    "mm_content_hashes": "multimodal inputs (mm_content_hashes) are",
    "use_audio_in_video": "multimodal inputs (use_audio_in_video) are",
    "video_config": "multimodal inputs (video_config) are",
    "modalities": "multimodal inputs (modalities) are",
    "max_dynamic_patch": "multimodal tiling (max_dynamic_patch) is",
    "min_dynamic_patch": "multimodal tiling (min_dynamic_patch) is",
    "image_max_dynamic_patch": "multimodal tiling (image_max_dynamic_patch) is",
    "video_max_dynamic_patch": "multimodal tiling (video_max_dynamic_patch) is",
    "images_config": "multimodal inputs (images_config) are",
    "mm_processor_kwargs": "multimodal inputs (mm_processor_kwargs) are",
    "need_wait_for_mm_inputs": "encoder disaggregation (need_wait_for_mm_inputs) is",
    "num_items_assigned": "encoder disaggregation (num_items_assigned) is",
    "encoder_urls": "encoder disaggregation (encoder_urls) is",
    "watermark": "watermarking is",
    "return_sampling_mask": "sampling masks (return_sampling_mask) are",
    "sampling_logprobs_mode": "sampling masks (sampling_logprobs_mode) are",
    "return_flat_raw_top_logprobs": "flat top-logprob arrays (return_flat_raw_top_logprobs) are",
    "return_flat_raw_output_top_logprobs": "flat top-logprob arrays (return_flat_raw_output_top_logprobs) are",
    "return_flat_raw_top_logprobs_b64": "flat top-logprob arrays (return_flat_raw_top_logprobs_b64) are",
    "return_hidden_states": "hidden states (return_hidden_states) are",
    "return_routed_experts": "routed experts (return_routed_experts; no MoE models) are",
    "routed_experts_start_len": "routed experts (routed_experts_start_len) are",
    "return_indexer_topk": "indexer top-k (return_indexer_topk) is",
    "session_params": "sessions (session_params) are",
    "session_id": "sessions (session_id) are",
    "lora_id": "LoRA adapter ids (lora_id; name the adapter with lora_name) are",
    "custom_logit_processor": "custom logit processors (custom_logit_processor) are",
    "positional_embed_overrides": "embedding overrides (positional_embed_overrides) are",
    "bootstrap_host": "prefill/decode disaggregation (bootstrap_host) is",
    "bootstrap_port": "prefill/decode disaggregation (bootstrap_port) is",
    "bootstrap_room": "prefill/decode disaggregation (bootstrap_room) is",
    "bootstrap_pair_key": "prefill/decode disaggregation (bootstrap_pair_key) is",
    "decode_tp_size": "prefill/decode disaggregation (decode_tp_size) is",
    "disagg_prefill_dp_rank": "prefill/decode disaggregation (disagg_prefill_dp_rank) is",
    "routing_key": "routing keys (routing_key) are",
    "conversation_id": "conversation tracking (conversation_id) is",
    "http_worker_ipc": "multi-tokenizer workers (http_worker_ipc) are",
    "background": "background requests (background) are",
    "require_reasoning": "reasoning control (require_reasoning) is",
    "max_thinking_tokens": "a top-level thinking budget (max_thinking_tokens; give sampling_params' "
                           "max_thinking_tokens and think_end) is",
    "priority": "request priorities (priority) are",
    "custom_labels": "custom metric labels (custom_labels) are",
    "return_bytes": "image generation (return_bytes) is",
    "return_entropy": "entropy outputs (return_entropy) are",
    "external_trace_header": "trace propagation (external_trace_header) is",
    "received_time": "external arrival times (received_time) are",
    "multi_item_delimiter_indices": "multi-item scoring (multi_item_delimiter_indices) is",
    "token_indices_to_pool": "setwise pooling (token_indices_to_pool) is",
    "kv_hints": "KV hints (kv_hints) are",
    "token_ids_logprob": "logprobs of chosen token ids (token_ids_logprob) are",
}


class GenerateRequest(_Strict):
    text: str | list[str] | None = None
    input_ids: list[int] | list[list[int]] | None = None
    sampling_params: dict[str, Any] | list[dict[str, Any]] | None = None  # see parse_sampling_params
    rid: str | list[str] | None = None  # a batch or n > 1 gets one rid per output, derived from a single one
    return_logprob: bool | list[bool] | None = None
    logprob_start_len: int | list[int] | None = None
    top_logprobs_num: int | list[int] | None = None
    return_text_in_logprobs: bool = False
    stream: bool = False
    log_metrics: bool = True
    return_prompt_token_ids: bool = False
    no_logs: bool = False  # radixgen never logs request contents: honoured either way
    cache_salt: str | list[str] | None = None  # requests share cached prefixes only with the same salt
    extra_key: str | list[str] | None = None  # SGLang's other cache namespace key: joined to the salt
    lora_name: str | list[str | None] | None = None  # a loaded LoRA adapter's name (per prompt in a list)
    lora_path: str | list[str | None] | None = None  # SGLang's name of lora_name (an adapter's name, not a folder)
    routed_dp_rank: int | None = None  # one data-parallel rank here: only 0
    data_parallel_rank: int | None = None
    # features radixgen lacks: only empty values
    # images for a text prompt: a path, base64, a data URL or (with --allow-remote-media) an http(s) URL, or a list
    # of them; for a batch, a list with one such entry (or null) per prompt
    image_data: str | list[str | list[str] | None] | None = None
    input_embeds: Any = None
    video_data: Any = None
    audio_data: Any = None
    mm_hashes: Any = None
    mm_content_hashes: Any = None
    use_audio_in_video: Any = None
    video_config: Any = None
    modalities: Any = None
    max_dynamic_patch: Any = None
    min_dynamic_patch: Any = None
    image_max_dynamic_patch: Any = None
    video_max_dynamic_patch: Any = None
    images_config: Any = None
    mm_processor_kwargs: Any = None
    need_wait_for_mm_inputs: Any = None
    num_items_assigned: Any = None
    encoder_urls: Any = None
    watermark: Any = None
    return_sampling_mask: Any = None
    sampling_logprobs_mode: Any = None
    return_flat_raw_top_logprobs: Any = None
    return_flat_raw_output_top_logprobs: Any = None
    return_flat_raw_top_logprobs_b64: Any = None
    return_hidden_states: Any = None
    return_routed_experts: Any = None
    routed_experts_start_len: Any = None
    return_indexer_topk: Any = None
    session_params: Any = None
    session_id: Any = None
    lora_id: Any = None
    custom_logit_processor: Any = None
    positional_embed_overrides: Any = None
    bootstrap_host: Any = None
    bootstrap_port: Any = None
    bootstrap_room: Any = None
    bootstrap_pair_key: Any = None
    decode_tp_size: Any = None
    disagg_prefill_dp_rank: Any = None
    routing_key: Any = None
    conversation_id: Any = None
    http_worker_ipc: Any = None
    background: Any = None
    require_reasoning: Any = None
    max_thinking_tokens: Any = None
    priority: Any = None
    custom_labels: Any = None
    return_bytes: Any = None
    return_entropy: Any = None
    external_trace_header: Any = None
    received_time: Any = None
    multi_item_delimiter_indices: Any = None
    token_indices_to_pool: Any = None
    kv_hints: Any = None
    token_ids_logprob: Any = None

    @field_validator(*_GENERATE_FEATURES)
    @classmethod
    def _features(cls, value: Any, info: ValidationInfo) -> Any:
        return _reject_features(value, info, _GENERATE_FEATURES)

    @model_validator(mode="after")
    def _checks(self) -> GenerateRequest:
        key, name = pick_lora_name(self.lora_name, self.lora_path)
        check_lora_name(name, key, per_prompt=True)
        if (self.text is None) == (self.input_ids is None):
            raise ValueError("exactly one of text and input_ids must be given (input_embeds is not supported)")
        if not self.log_metrics:
            raise ValueError("log_metrics=false is not supported: every request is counted in /metrics")
        for name in ("routed_dp_rank", "data_parallel_rank"):
            if getattr(self, name) not in (None, 0):
                raise ValueError(f"{name}: this server has one data-parallel rank (0)")
        size = self.batch_size
        for name in ("rid", "return_logprob", "logprob_start_len", "top_logprobs_num", "cache_salt",
                     "extra_key", "lora_name", "lora_path", "sampling_params"):
            value = getattr(self, name)
            if isinstance(value, list) and (size is None or len(value) != size):
                raise ValueError(f"{name}: a list needs a batch of prompts of the same length "
                                 f"(got {len(value)} for {'one prompt' if size is None else size})")
        if self.image_data is not None:
            if self.text is None:
                raise ValueError("image_data: goes with a text prompt, not input_ids")
            if size is not None and (not isinstance(self.image_data, list) or len(self.image_data) != size):
                raise ValueError(f"image_data: a batch of {size} prompts needs a list with one entry per prompt")
            if size is None and isinstance(self.image_data, list) and any(isinstance(x, list) for x in self.image_data):
                raise ValueError("image_data: one prompt takes an image or a flat list of images")
        if isinstance(self.rid, list) and len(set(self.rid)) != len(self.rid):
            raise ValueError("rid: the rids of a batch must be distinct")
        if size == 0:
            raise ValueError("the prompt list is empty")
        return self

    @property
    def lora(self) -> tuple[str, Any]:
        """(the keyword the request named its adapter with, the adapter or one per prompt; None: the base model)."""
        return pick_lora_name(self.lora_name, self.lora_path)

    @property
    def is_batch(self) -> bool:
        return self.batch_size is not None

    @property
    def batch_size(self) -> int | None:
        """The number of prompts of a batch; None for a single prompt."""
        if self.text is not None:
            return len(self.text) if isinstance(self.text, list) else None
        ids = self.input_ids or []
        return len(ids) if ids and isinstance(ids[0], list) else None


# ---------------------------------------------------------------- LoRA adapters


class _LoRABody(_Strict):
    lora_id: str | None = None  # SGLang assigns it itself; only null here

    @model_validator(mode="after")
    def _no_id(self) -> _LoRABody:
        if self.lora_id is not None:
            raise ValueError("lora_id: adapters are known by lora_name here (send null)")
        return self


class LoadLoRAAdapterRequest(_LoRABody):
    """SGLang's /load_lora_adapter body: serve the PEFT folder `lora_path` as `lora_name`."""

    lora_name: str
    lora_path: str
    pinned: bool = False  # never replaced in the adapter pool


class UnloadLoRAAdapterRequest(_LoRABody):
    lora_name: str


# ---------------------------------------------------------------- other routes


class TokenizeRequest(_Strict):
    """radixgen's `text` (a list answers a list of objects) or SGLang's `prompt` (a list answers one object
    with lists); `messages` go through the chat template."""

    text: str | list[str] | None = None
    prompt: str | list[str] | None = None
    messages: list[dict[str, Any]] | None = None
    add_special_tokens: bool = True
    model: str | None = None  # SGLang clients send the served model's name; one model is served here

    @model_validator(mode="after")
    def _one_input(self) -> TokenizeRequest:
        if sum(x is not None for x in (self.text, self.prompt, self.messages)) != 1:
            raise ValueError("exactly one of text, prompt and messages must be given")
        return self


class DetokenizeRequest(_Strict):
    tokens: list[int] | list[list[int]]
    skip_special_tokens: bool = True  # SGLang's default
    model: str | None = None


class AbortRequest(_Strict):
    rid: str = ""
    abort_all: bool = False  # SGLang's: abort every running request (rid is then not needed)

    @model_validator(mode="after")
    def _target(self) -> AbortRequest:
        if not self.rid and not self.abort_all:
            raise ValueError("rid is required (or abort_all: true)")
        return self


class ConcateAndAppendRequest(_Strict):
    """SGLang's fork/join `concate_and_append` hint: the client has appended the branches' text to the
    destination state itself; the server may reuse their KV for it."""

    src_rids: list[str] = Field(min_length=1)
    dst_rid: str
