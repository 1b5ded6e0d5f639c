"""What the Engine knows of one request: its output so far, detokenized incrementally, and the result dicts
handed to callers. Updated by the Engine's receiver thread, read by whoever waits on the request."""

from __future__ import annotations

import threading
from typing import Any

from radixgen.common.sampling_params import SamplingParams
from radixgen.runtime.detokenizer import IncrementalDetokenizer
from radixgen.runtime.messages import FinishReason, ReqOutput, SpecCounts


class RequestError(ValueError):
    """A request the runtime rejected (bad parameters, a grammar that does not compile, too large for the KV
    pool...): the caller's fault, answered with 400 by the server."""


class RequestFailed(Exception):
    """One request failed inside the runtime (e.g. its output could not be detokenized). Only that request
    ended; the engine goes on serving the others."""


def as_finish_reason(reason: FinishReason | dict | None) -> FinishReason | None:
    """The typed finish reason; a dict in the wire shape ({"type": ...}) is converted (older schedulers)."""
    if reason is None or isinstance(reason, FinishReason):
        return reason
    return FinishReason(reason["type"], matched=reason.get("matched"), length=reason.get("length"),
                        message=reason.get("message"), status_code=reason.get("status_code"),
                        fatal=bool(reason.get("fatal", False)))


class RequestState:
    """One request as the Engine sees it. `notify` (set by the waiter) is called after every update.

    The receiver thread applies outputs while a waiter (another thread, or an event loop) builds results: both
    hold `lock`, so a result never counts a token whose logprob or text it does not carry yet."""

    def __init__(self, rid: str, input_ids: list[int], params: SamplingParams, tokenizer,
                 return_logprob: bool, text_in_logprobs: bool) -> None:
        self.rid = rid
        self.params = params
        self.input_ids = input_ids
        self.prompt_tokens = len(input_ids)
        self.cached_tokens = 0
        self.cached_details: dict | None = None  # by tier, with the hierarchical cache
        self.output_ids: list[int] = []
        self.detok = IncrementalDetokenizer(tokenizer, params.skip_special_tokens)
        self.tokenizer = tokenizer
        self.return_logprob = return_logprob
        self.text_in_logprobs = text_in_logprobs
        self.finish_reason: FinishReason | None = None
        self.final_text: str | None = None
        self.output_logprobs: list = []
        self.output_top: list = []
        self.input_logprobs: list | None = None
        self.input_top: list | None = None
        self.sent_text_len = 0
        self.spec: SpecCounts | None = None  # with speculative decoding on
        self.pooled: list[float] | None = None  # an embed / score request's result (runtime/pooling.py)
        self.notify = None  # callable, set by the waiter
        self.holdback = max((len(s) for s in params.stop), default=1) - 1
        self.lock = threading.Lock()

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def apply(self, out: ReqOutput) -> None:
        """Take in one step's output. May raise (a tokenizer that fails on these ids): the caller then
        ends this request with `fail`."""
        with self.lock:
            self._apply(out)

    def _apply(self, out: ReqOutput) -> None:
        self.cached_tokens = out.cached_tokens
        self.cached_details = out.cached_details
        self.spec = out.spec
        if out.pooled is not None:
            self.pooled = out.pooled
        self.output_ids += out.new_ids
        self.detok.add(out.new_ids)
        if self.return_logprob:
            self.output_logprobs += [self._entry(lp, t) for lp, t in
                                     zip(out.output_logprobs, out.new_ids, strict=False)]
            self.output_top += [[self._entry(lp, t) for lp, t in zip(*top, strict=True)]
                                for top in out.output_top]
        if out.input_logprobs is not None:
            start = len(self.input_ids) - len(out.input_logprobs)
            ids = self.input_ids[start:]
            self.input_logprobs = [self._entry(lp, t) for lp, t in zip(out.input_logprobs, ids, strict=True)]
            if out.input_top is not None and any(t is not None for t in out.input_top):
                self.input_top = [None if top is None else [self._entry(lp, t) for lp, t in zip(*top, strict=True)]
                                  for top in out.input_top]
        reason = as_finish_reason(out.finish_reason)
        if reason is not None:
            self.detok.flush()
            self.final_text = self._trimmed_text(reason)
            self.finish_reason = reason  # last: a waiter that sees it finished sees everything

    def fail(self, message: str, status_code: int | None = None, fatal: bool = False) -> None:
        """End the request here (the scheduler may still run it: the caller aborts it there)."""
        with self.lock:
            if self.finish_reason is None:
                self.final_text = self.detok.text
                self.finish_reason = FinishReason.abort(message, status_code=status_code, fatal=fatal)

    def _entry(self, lp, tok: int):
        text = self.tokenizer.decode([tok]) if self.text_in_logprobs else None
        return (lp, tok, text)

    def _trimmed_text(self, reason: FinishReason) -> str:
        text, p = self.detok.text, self.params
        if reason.kind != "stop" or p.no_stop_trim:
            return text
        matched = reason.matched
        if isinstance(matched, str):
            idx = text.rfind(matched)
            return text[:idx] if idx >= 0 else text
        if isinstance(matched, int) and self.output_ids and self.output_ids[-1] == matched:
            return self.tokenizer.decode(self.output_ids[:-1], skip_special_tokens=p.skip_special_tokens)
        return text

    def visible_text(self) -> str:
        if self.final_text is not None:
            return self.final_text
        text = self.detok.text
        # hold back what could still turn out to be the start of a stop string
        return text[:len(text) - self.holdback] if self.holdback > 0 else text

    def raise_for_failure(self) -> None:
        """RuntimeError when the runtime is gone, RequestError (400) for a rejected request, RequestFailed for
        a request that failed inside the runtime. A plain abort (asked for by the caller) is a result."""
        reason = self.finish_reason
        if reason is None or reason.kind != "abort":
            return
        if reason.fatal:
            raise RuntimeError(reason.message)
        if reason.status_code == 400:
            raise RequestError(reason.message)
        if reason.status_code is not None and reason.status_code >= 500:
            raise RequestFailed(reason.message)

    def result(self, delta: bool = False) -> dict:
        with self.lock:
            return self._result(delta)

    def _result(self, delta: bool) -> dict:
        text = self.visible_text()
        meta: dict[str, Any] = {
            "id": self.rid, "prompt_tokens": self.prompt_tokens, "completion_tokens": len(self.output_ids),
            "cached_tokens": self.cached_tokens,
            "finish_reason": None if self.finish_reason is None else self.finish_reason.to_json(),
        }
        if self.cached_details is not None:
            meta["cached_tokens_details"] = dict(self.cached_details)
        if self.spec is not None:  # SGLang's names
            sp = self.spec
            meta.update(spec_verify_ct=sp.verify_ct, spec_draft_token_num=sp.draft_tokens,
                        spec_accept_token_num=sp.accepted_tokens)
            if sp.verify_ct:
                meta["spec_accept_length"] = len(self.output_ids) / sp.verify_ct
            if sp.draft_tokens:
                meta["spec_accept_rate"] = sp.accepted_tokens / sp.draft_tokens
        if self.return_logprob:
            meta["input_token_logprobs"] = self.input_logprobs or []
            meta["output_token_logprobs"] = list(self.output_logprobs)
            meta["input_top_logprobs"] = self.input_top or []
            meta["output_top_logprobs"] = list(self.output_top)
        out = {"text": text, "output_ids": list(self.output_ids), "meta_info": meta}
        if delta:
            out["delta"] = text[self.sent_text_len:]
            self.sent_text_len = len(text)
        return out
