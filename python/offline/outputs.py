"""vLLM-shaped results of `LLM.generate` / `LLM.chat`, built from the Engine's result dicts."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class Logprob:
    logprob: float
    rank: int | None = None  # 1 = most likely; None for a sampled token outside the top logprobs
    decoded_token: str | None = None


PositionLogprobs = dict[int, Logprob]  # token id -> its logprob, at one position


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None  # set when logprobs were asked for
    logprobs: list[PositionLogprobs] | None
    finish_reason: str | None  # "stop" (EOS, a stop string or stop token) or "length"
    stop_reason: int | str | None = None  # the stop string or stop token id that ended it; None for EOS

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    prompt_logprobs: list[PositionLogprobs | None] | None
    outputs: list[CompletionOutput]
    finished: bool = True
    num_cached_tokens: int = 0  # prompt tokens the radix cache already held
    metrics: dict[str, Any] = field(default_factory=dict)


def finish_parts(reason: Any) -> tuple[str | None, Any]:
    """(kind, matched) of the Engine's finish reason."""
    if reason is None:
        return None, None
    if isinstance(reason, dict):
        return reason.get("type"), reason.get("matched")
    return getattr(reason, "kind", None) or getattr(reason, "type", None), getattr(reason, "matched", None)


def position(sampled: tuple, top: list[tuple] | None, k: int) -> PositionLogprobs:
    """One position's logprobs: the sampled (or prompt) token first, then the k most likely."""
    lp, tid, text = sampled
    ranked = {t: Logprob(float(v), r, s) for r, (v, t, s) in enumerate((top or [])[:k], 1)}
    out = {tid: ranked.pop(tid, None) or Logprob(float(lp), None, text)}
    out.update(ranked)
    return out


def completion(index: int, result: dict, params: Any, eos_ids: set[int]) -> CompletionOutput:
    meta = result["meta_info"]
    kind, matched = finish_parts(meta.get("finish_reason"))
    user_stop_ids = set(getattr(params, "stop_token_ids", None) or [])
    if isinstance(matched, int) and matched in eos_ids and matched not in user_stop_ids:
        matched = None  # vLLM's stop_reason is None when the model's own EOS ended the output
    logprobs, cumulative = None, None
    k = getattr(params, "logprobs", None)
    if k is not None:
        sampled, tops = meta.get("output_token_logprobs") or [], meta.get("output_top_logprobs") or []
        logprobs = [position(s, tops[i] if i < len(tops) else None, k) for i, s in enumerate(sampled)]
        cumulative = float(sum(s[0] for s in sampled))
    return CompletionOutput(index, result["text"], list(result["output_ids"]), cumulative, logprobs, kind, matched)


def prompt_logprobs(result: dict, k: int) -> list[PositionLogprobs | None]:
    meta = result["meta_info"]
    entries, tops = meta.get("input_token_logprobs") or [], meta.get("input_top_logprobs") or []
    out: list[PositionLogprobs | None] = []
    for i, entry in enumerate(entries):
        top = tops[i] if i < len(tops) else None
        out.append(None if entry[0] is None else position(entry, top, k))
    return out


def request_output(
    request_id: str, prompt: str | None, ids: list[int], results: list[dict], params: Any, eos_ids: set[int]
) -> RequestOutput:
    """One RequestOutput from the n results of one prompt."""
    k = getattr(params, "prompt_logprobs", None)
    return RequestOutput(
        request_id=request_id,
        prompt=prompt,
        prompt_token_ids=list(ids),
        prompt_logprobs=None if k is None else prompt_logprobs(results[0], k),
        outputs=[completion(i, r, params, eos_ids) for i, r in enumerate(results)],
        num_cached_tokens=int(results[0]["meta_info"].get("cached_tokens") or 0),
    )
