"""The Engine's front-end checks: everything about a generate call that can be judged before it is sent to the
scheduler. Each failure is a RequestError (a ValueError) naming the field and the limit it breaks."""

from __future__ import annotations

import uuid
from typing import Any, NamedTuple

from radixgen.common.lora_names import check_lora_name, pick_lora_name
from radixgen.common.prompt import MediaItem, MediaSegment, Prompt, TextSegment
from radixgen.common.sampling_params import SamplingParams, check_text, choice_seeds, is_int
from radixgen.runtime.engine.request_state import RequestError
from radixgen.runtime.messages import GenerateRequest

MAX_TOP_LOGPROBS = 100


class ModelLimits(NamedTuple):
    """What the running model and scheduler can take (from the ready signal)."""

    vocab_size: int
    context_length: int
    num_kv_slots: int  # KV pool capacity in tokens
    supports_constraints: bool
    strict_json: bool


class Prepared(NamedTuple):
    batched: bool  # the caller gets a list of results
    base_rid: str  # the caller's rid (or a fresh one); derived rids are f"{base}-{prompt}-{choice}"
    requests: list[GenerateRequest]


def _reject(message: str) -> RequestError:
    return RequestError(message)


def check_unicode(name: str, text: str) -> None:
    """RequestError when `text` is not valid Unicode (a lone surrogate such as "\\ud800")."""
    try:
        check_text(name, text)
    except ValueError as e:
        raise RequestError(str(e)) from None


def prompt_texts(prompt: Any) -> tuple[bool, list[str]]:
    """(batched, texts) of a `prompt` argument: a string or a non-empty list of strings of valid Unicode."""
    batched = isinstance(prompt, (list, tuple))
    texts = list(prompt) if batched else [prompt]
    if not all(isinstance(t, str) for t in texts):
        raise _reject("prompt: must be a string or a list of strings")
    if batched and not texts:
        raise _reject("prompt: the prompt list is empty")
    for t in texts:
        check_unicode("prompt", t)
    return batched, texts


def segmented_prompts(prompt: Any) -> tuple[bool, list[Prompt]] | None:
    """(batched, prompts) when `prompt` is a `Prompt` or a non-empty list of them, else None (text prompts).
    Media segments are processed later (engine/media_input.py), which refuses them for a text-only model."""
    batched = isinstance(prompt, (list, tuple))
    prompts = list(prompt) if batched else [prompt]
    if not prompts or not all(isinstance(p, Prompt) for p in prompts):
        return None
    for p in prompts:
        for seg in p.segments:
            if isinstance(seg, TextSegment):
                check_unicode("prompt", seg.text)
    return batched, prompts


def segment_texts(prompts: list[Prompt]) -> tuple[list[str], list[str]]:
    """The texts to tokenize: (first segments, with special tokens as a plain text prompt; later ones, without)."""
    first = [p.segments[0].text for p in prompts if p.segments and isinstance(p.segments[0], TextSegment)]
    rest = [s.text for p in prompts for s in p.segments[1:] if isinstance(s, TextSegment)]
    return first, rest


def assemble_ids(prompts: list[Prompt], first_ids: list[list[int]], rest_ids: list[list[int]],
                 vocab_size: int, media: list[list] | None = None) -> tuple[list[list[int]], list[tuple]]:
    """Each prompt's ids, its segments' in order (the tokenized texts as `segment_texts` listed them), and its
    MediaItems: `media[i]` holds prompt i's processed media segments in order (media_input.ProcessedSegment),
    each standing in the ids as its tokens, its item over their placeholder span."""
    firsts, rests = iter(first_ids), iter(rest_ids)
    out, items = [], []
    for i, p in enumerate(prompts):
        ids: list[int] = []
        mine: list[MediaItem] = []
        processed = iter(media[i] if media is not None else ())
        for k, seg in enumerate(p.segments):
            if isinstance(seg, TextSegment):
                ids += next(firsts) if k == 0 else next(rests)
            elif isinstance(seg, MediaSegment):
                tokens, content_hash, item = next(processed)
                mine.append(MediaItem(seg.kind, content_hash, len(ids) + tokens.start, len(ids) + tokens.end, item))
                ids += tokens.ids
            else:
                ids += prompt_ids(list(seg.ids), vocab_size)[1][0]
        out.append(ids)
        items.append(tuple(mine))
    return out, items


def prompt_ids(input_ids: Any, vocab_size: int) -> tuple[bool, list[list[int]]]:
    """(batched, ids) of an `input_ids` argument: a list of token ids or a non-empty list of such lists;
    ids are ints (not bools) in [0, vocab_size)."""
    if not isinstance(input_ids, (list, tuple)):
        raise _reject("input_ids: must be a list of token ids or a list of such lists")
    batched = bool(input_ids) and isinstance(input_ids[0], (list, tuple))
    seqs = list(input_ids) if batched else [input_ids]
    out = []
    for seq in seqs:
        if not isinstance(seq, (list, tuple)):
            raise _reject("input_ids: must be a list of token ids or a list of such lists")
        for t in seq:
            if not is_int(t):
                raise _reject(f"input_ids: token ids must be integers, got {t!r}")
            if not 0 <= t < vocab_size:
                raise _reject(f"input_ids: token id {t} is out of the vocabulary [0, {vocab_size})")
        out.append(list(seq))
    return batched, out


def kv_slots_needed(prompt_len: int, max_new_tokens: int) -> int:
    """KV slots a request holds at its largest: the prompt, then one per generated token except the last
    (a finished request never computes the KV of its last token)."""
    return prompt_len + max(max_new_tokens - 1, 0)


def check_fits(prompt_len: int, max_new_tokens: int, limits: ModelLimits) -> None:
    """The request fits the context length and, even alone, the KV pool (a request the pool can never hold
    would otherwise wait or be cut short): a RequestError naming both sizes."""
    if not prompt_len:
        raise _reject("prompt: the prompt is empty (no tokens)")
    if prompt_len + max_new_tokens > limits.context_length:
        raise _reject(f"the prompt ({prompt_len} tokens) plus max_new_tokens ({max_new_tokens}) exceeds the "
                      f"context length ({limits.context_length} tokens)")
    need = kv_slots_needed(prompt_len, max_new_tokens)
    if need > limits.num_kv_slots:
        raise _reject(f"the prompt ({prompt_len} tokens) plus max_new_tokens ({max_new_tokens}) needs {need} "
                      f"KV cache slots, more than the KV pool holds ({limits.num_kv_slots} tokens)")


def check_params(params: SamplingParams, limits: ModelLimits) -> None:
    """What SamplingParams cannot check alone: token ids against the vocabulary, constraints compile."""
    bad = [t for t in params.stop_token_ids if t >= limits.vocab_size]
    if bad:
        raise _reject(f"sampling_params.stop_token_ids: token id {bad[0]} is out of the vocabulary "
                      f"[0, {limits.vocab_size})")
    bad = [t for t in (params.logit_bias or {}) if t >= limits.vocab_size]
    if bad:
        raise _reject(f"sampling_params.logit_bias: token id {bad[0]} is out of the vocabulary "
                      f"[0, {limits.vocab_size})")
    if params.constraint is not None:
        if not limits.supports_constraints:
            raise _reject("constrained decoding (regex / json_schema / ebnf / choices) is not available")
        from radixgen.runtime.grammar import check_constraint

        check_constraint(*params.constraint, strict_json=limits.strict_json)


def sampling_params_list(sampling_params: Any, count: int) -> list[SamplingParams]:
    """One SamplingParams per prompt: a dict (or SamplingParams, or None) for all, or a list with one each."""
    if isinstance(sampling_params, (list, tuple)):
        if len(sampling_params) != count:
            raise _reject(f"sampling_params: got {len(sampling_params)} for {count} prompts")
        return [SamplingParams.from_dict(p) for p in sampling_params]
    return [SamplingParams.from_dict(sampling_params)] * count


def lora_names(lora_name: Any, count: int, loras: dict[str, str] | None,
               key: str = "lora_name") -> list[str | None]:
    """One LoRA adapter name (None: the base model) per prompt, from a name for all or a list with one per prompt;
    each must be loaded (`loras`: the loaded adapters, None when LoRA is not enabled). `key`: the keyword the
    caller used (lora_name, or SGLang's lora_path), named in errors."""
    if lora_name is None:
        return [None] * count
    check_lora_name(lora_name, key, per_prompt=True)
    names = list(lora_name) if isinstance(lora_name, (list, tuple)) else [lora_name] * count
    if len(names) != count:
        raise _reject(f"{key}: got {len(names)} for {count} prompts")
    for name in names:
        if name is None:
            continue
        if loras is None:
            raise _reject(f"{key}: LoRA adapters are not enabled on this server (start it with --lora-paths "
                          "or --enable-lora)")
        if name not in loras:
            raise _reject(f"{key}: unknown LoRA adapter {name!r} (loaded: {sorted(loras)})")
    return names


def build_requests(batched: bool, ids_list: list[list[int]], sampling_params: Any, limits: ModelLimits,
                   **kw: Any) -> Prepared:
    """Validate one generate call and build its scheduler requests (one per prompt and choice); nothing is
    sent. A request with n > 1 becomes n requests with n=1, choice k seeded with seed + k. Keyword arguments:
    return_logprob, logprob_start_len, top_logprobs_num, rid, cache_salt, lora_name / lora_path (as Engine.generate),
    loras (the loaded LoRA adapters, see lora_names) and media (each prompt's MediaItems)."""
    try:
        return _build(batched, ids_list, sampling_params, limits, **kw)
    except RequestError:
        raise
    except ValueError as e:  # from SamplingParams, choice_seeds, the grammar check: all the request's fault
        raise RequestError(str(e)) from None


def _build(batched: bool, ids_list: list[list[int]], sampling_params: Any, limits: ModelLimits, *,
           return_logprob: bool = False, logprob_start_len: int = -1, top_logprobs_num: int = 0,
           rid: str | None = None, cache_salt: str | None = None, lora_name: Any = None, lora_path: Any = None,
           loras: dict[str, str] | None = None, media: list[tuple] | None = None) -> Prepared:
    params_list = sampling_params_list(sampling_params, len(ids_list))
    key, named = pick_lora_name(lora_name, lora_path)
    adapters = lora_names(named, len(ids_list), loras, key)
    if not isinstance(return_logprob, bool):
        raise _reject(f"return_logprob: must be a boolean, got {return_logprob!r}")
    if not is_int(logprob_start_len) or logprob_start_len < -1:
        raise _reject(f"logprob_start_len: must be an integer >= -1, got {logprob_start_len!r}")
    if not is_int(top_logprobs_num) or not 0 <= top_logprobs_num <= MAX_TOP_LOGPROBS:
        raise _reject(f"top_logprobs_num: must be an integer in [0, {MAX_TOP_LOGPROBS}], got {top_logprobs_num!r}")
    if cache_salt is not None:
        if not isinstance(cache_salt, str):
            raise _reject("cache_salt: must be a string")
        check_unicode("cache_salt", cache_salt)
    if rid is not None:
        if not isinstance(rid, str):
            raise _reject(f"rid: must be a string, got {rid!r}")
        check_unicode("rid", rid)
    base = rid or uuid.uuid4().hex
    reqs = []
    single = len(ids_list) == 1 and params_list[0].n == 1
    media = media if media is not None else [()] * len(ids_list)
    for i, (ids, params, adapter) in enumerate(zip(ids_list, params_list, adapters, strict=True)):
        check_fits(len(ids), params.max_new_tokens, limits)
        if logprob_start_len > len(ids):
            raise _reject(f"logprob_start_len: {logprob_start_len} is past the prompt ({len(ids)} tokens)")
        check_params(params, limits)
        seeds = choice_seeds(params.seed, params.n)
        for k, seed in enumerate(seeds):
            p = params if params.n == 1 else SamplingParams.from_dict({**params.to_dict(), "n": 1, "seed": seed})
            sub = base if single else f"{base}-{i}-{k}"
            reqs.append(GenerateRequest(sub, ids, p, return_logprob, logprob_start_len, top_logprobs_num,
                                        cache_salt, adapter, media[i]))
    return Prepared(batched or len(reqs) > 1, base, reqs)
