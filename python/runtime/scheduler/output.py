"""Output processing, one request at a time: sampled tokens, grammar advance and jump-forward, stop conditions,
logprobs, and the `ReqOutput` record each step sends to the Engine.

Nothing here finishes a request: the checks return a `FinishReason` and the scheduler's `finish` (which always
emits) applies it.
"""

from __future__ import annotations

import logging
from dataclasses import replace
from typing import NamedTuple

import torch

from radixgen.common.stop_regex import StopRegexMatcher
from radixgen.runtime.config import RuntimeConfig
from radixgen.runtime.detokenizer import IncrementalDetokenizer
from radixgen.runtime.executor.prompt_logprobs import prompt_logprobs
from radixgen.runtime.executor.sampler import Sampler, SamplingBatch
from radixgen.runtime.scheduler.batch import Batch
from radixgen.runtime.scheduler.request import FinishReason, Req, ReqOutput, SpecCounts
from radixgen.runtime.scheduler.thinking import ThinkingBudget

logger = logging.getLogger(__name__)


class Sampled(NamedTuple):
    token: int
    logprob: float | None
    top: tuple[list[float], list[int]] | None


class RegexStop:
    """A request's stop regexes, fed the newly decoded text after each step (linear time, see stop_regex.py)."""

    def __init__(self, stop_regex, tokenizer, skip_special_tokens: bool) -> None:
        self.matcher = StopRegexMatcher(stop_regex)
        self.detok = IncrementalDetokenizer(tokenizer, skip_special_tokens)
        self.fed = 0  # output ids given to the detokenizer
        self.matched: str | None = None

    def update(self, output_ids: list[int]) -> str | None:
        if self.matched is None and len(output_ids) > self.fed:
            text = self.detok.add(output_ids[self.fed:])
            self.fed = len(output_ids)
            if text:
                self.matched = self.matcher.feed(text)
        return self.matched


class OutputProcessor:
    def __init__(self, cfg: RuntimeConfig, tokenizer, grammar, vocab_size: int, eos_ids: set[int],
                 context_length: int, counters: dict) -> None:
        self.cfg = cfg
        self.tokenizer = tokenizer
        self.grammar = grammar
        self.vocab_size = vocab_size
        self.eos_ids = eos_ids
        self.context_length = context_length
        self.counters = counters
        self.sampler = Sampler()
        self.thinking = ThinkingBudget(tokenizer)

    # ------------------------------------------------------------------ sampling

    def sample(self, batch: Batch, logits: torch.Tensor) -> tuple[dict[int, list[Sampled]], dict[int, Exception]]:
        """The sampled tokens of each request (by batch index) that samples this step, one per logits row it has
        (a verification's request: one after its last token and one after each draft), and the requests whose
        sampling failed. A failure of the batched call is retried request by request, so it fails only the
        requests that cause it."""
        idx = [i for i, row in enumerate(batch.sample_rows) if row >= 0]
        if not idx:
            return {}, {}
        try:
            return self._sample(batch, logits, idx), {}
        except Exception as e:  # noqa: BLE001 - isolated below
            if len(idx) == 1:
                return {}, {idx[0]: e}
            logger.warning("batched sampling failed (%s: %s); sampling request by request", type(e).__name__, e)
        done: dict[int, list[Sampled]] = {}
        failed: dict[int, Exception] = {}
        for i in idx:
            try:
                done.update(self._sample(batch, logits, [i]))
            except Exception as e:  # noqa: BLE001 - fails this request alone
                failed[i] = e
        return done, failed

    def _sample(self, batch: Batch, logits: torch.Tensor, idx: list[int]) -> dict[int, list[Sampled]]:
        """One sampler call over the rows of the requests `idx`. A verification's request has a row after its
        last token and after each draft: row j samples as the request would after drafts[:j] were appended
        (penalties count them, min_new_tokens and the grammar's state follow them)."""
        reqs = [batch.reqs[i] for i in idx]
        drafts = [batch.drafts[i] for i in idx] if batch.drafts is not None else [[] for _ in idx]
        rows_of = [(k, j) for k, d in enumerate(drafts) for j in range(len(d) + 1)]  # (request, draft prefix)
        rows = logits[[batch.sample_rows[idx[k]] + j for k, j in rows_of]]  # (S, V), a copy
        for r, (k, j) in enumerate(rows_of):  # min_new_tokens: no stop token before then
            if len(reqs[k].output_ids) + j < reqs[k].params.min_new_tokens:
                rows[r, list(self.stop_token_ids(reqs[k]))] = float("-inf")
            if reqs[k].params.max_thinking_tokens is not None:  # a think block closed at its budget
                forced = self.thinking.forced(reqs[k].params, _output_with(reqs[k], drafts[k][:j]))
                if forced is not None:
                    rows[r] = float("-inf")
                    rows[r, forced] = 0.0
        row_reqs = [reqs[k] for k, _ in rows_of]
        sb = SamplingBatch.build([r.params for r in row_reqs],
                                 [_output_with(reqs[k], drafts[k][:j]) for k, j in rows_of],
                                 [r.input_ids for r in row_reqs], [r.generator for r in row_reqs], self.vocab_size)
        want_lp = any(r.return_logprob for r in reqs)
        apply_mask = None
        if self.grammar is not None:
            apply_mask = self.grammar.mask_fn(reqs) if batch.drafts is None else self.grammar.mask_fn(reqs, drafts)
        out = self.sampler(rows, sb, apply_mask=apply_mask, return_logprob=want_lp,
                           top_logprobs_num=[r.top_logprobs_num if r.return_logprob else 0 for r in row_reqs])
        if out.failed_rows:  # no allowed token (NaN logits, everything masked): retried alone, then failed
            rids = sorted({row_reqs[j].rid for j in out.failed_rows})
            raise RuntimeError(f"no token could be sampled for {rids}: every logit is NaN / -inf or masked")
        ids = out.next_ids.tolist()
        result: dict[int, list[Sampled]] = {i: [] for i in idx}
        for r, (k, _) in enumerate(rows_of):
            req = reqs[k]
            lp = float(out.logprobs[r]) if req.return_logprob else None
            top = None
            if req.return_logprob and req.top_logprobs_num:
                top = (out.top_logprobs[r].logprobs, out.top_logprobs[r].token_ids)
            result[idx[k]].append(Sampled(int(ids[r]), lp, top))
        return result

    # ------------------------------------------------------------------ tokens

    def append_token(self, req: Req, s: Sampled) -> FinishReason | None:
        """Append a sampled token; advance the grammar (and jump forward). A grammar rejection finishes."""
        req.output_ids.append(s.token)
        self.counters["generation_tokens"] += 1
        if req.return_logprob:
            req.output_logprobs.append(s.logprob)
            if req.top_logprobs_num:
                req.output_top.append(s.top)
        if req.grammar is not None:
            if not req.grammar.accept_token(s.token):
                return FinishReason.abort(f"grammar rejected token {s.token}")
            if self.cfg.enable_jump_forward and not req.grammar.is_terminated():
                self.jump_forward(req)
        return None

    def append_tokens(self, req: Req, tokens: list[Sampled]) -> tuple[FinishReason | None, int]:
        """Append a step's tokens one by one, each through the stop checks, up to the first that finishes the
        request (a verification can accept several at once): (its reason or None, how many were appended). A
        jump-forward after a token ends the step's tokens there: those after it followed another text."""
        for n, s in enumerate(tokens, 1):
            before = len(req.output_ids)
            reason = self.append_token(req, s) or self.check_finished(req)
            if reason is not None or len(req.output_ids) > before + 1:
                return reason, n
        return None, len(tokens)

    def jump_forward(self, req: Req) -> None:
        forced = self.grammar.jump_forward(req.grammar, self.tokenizer, req.output_ids)
        budget = req.params.max_new_tokens - len(req.output_ids)
        for tok in forced[:budget]:
            req.output_ids.append(tok)
            self.counters["jump_forward_tokens"] += 1
            if req.return_logprob:
                req.output_logprobs.append(0.0)
                if req.top_logprobs_num:
                    req.output_top.append(([0.0], [tok]))

    # ------------------------------------------------------------------ stop conditions

    def stop_token_ids(self, req: Req) -> set[int]:
        ids = set(req.params.stop_token_ids)
        if not req.params.ignore_eos:
            ids |= self.eos_ids
        return ids

    def check_finished(self, req: Req) -> FinishReason | None:
        p = req.params
        if req.to_abort:
            return FinishReason.abort(req.to_abort)
        if not req.output_ids:
            return FinishReason.length_limit(0) if p.max_new_tokens == 0 else None
        last = req.output_ids[-1]
        n = len(req.output_ids)
        regex_hit = req.regex_stop.update(req.output_ids) if req.regex_stop is not None else None
        reason = None
        if n >= p.min_new_tokens and last in self.stop_token_ids(req):
            reason = FinishReason.stop(last)
        elif req.grammar is not None and req.grammar.is_terminated():
            reason = FinishReason.stop(None)
        elif n >= p.min_new_tokens and p.stop:
            reason = self.check_stop_strings(req)
        if reason is None and n >= p.min_new_tokens and regex_hit is not None:
            reason = FinishReason.stop(regex_hit)
        if reason is None and n >= p.max_new_tokens:
            reason = FinishReason.length_limit(p.max_new_tokens)
        if reason is None and req.seq_len >= self.context_length:
            reason = FinishReason.length_limit(n)
        return reason

    def check_stop_strings(self, req: Req) -> FinishReason | None:
        p = req.params
        # the new token may complete a stop string begun in earlier tokens
        longest = max(len(s) for s in p.stop)
        tail = self.tokenizer.decode(req.output_ids[-(longest + 2):], skip_special_tokens=p.skip_special_tokens)
        for s in p.stop:
            if s in tail:
                return FinishReason.stop(s)
        return None

    # ------------------------------------------------------------------ prompt logprobs

    def collect_prompt_logprobs(self, req: Req, batch: Batch, i: int, logits: torch.Tensor) -> None:
        positions = batch.prompt_lp_rows[i]
        first = batch.lp_first[i]
        rows = logits[first:first + len(positions)]
        targets = torch.tensor([req.input_ids[p] for p in positions], dtype=torch.int64)
        out = prompt_logprobs(rows, targets, top_k=req.top_logprobs_num, vocab_size=self.vocab_size)
        values = out.logprobs.tolist()
        top = None
        if out.top is not None:
            top = list(zip(out.top.values.tolist(), out.top.ids.tolist(), strict=True))
        for k, pos in enumerate(positions):
            req.pending_input_lp[pos] = (values[k], top[k] if top else None)

    @staticmethod
    def finalize_prompt_logprobs(req: Req) -> None:
        lp, top = [], []
        for pos in range(req.logprob_start_len, len(req.input_ids)):
            v, t = req.pending_input_lp.get(pos, (None, None))
            lp.append(v)
            top.append(t)
        req.input_logprobs, req.input_top = lp, top
        req.pending_input_lp = {}

    # ------------------------------------------------------------------ the record sent to the Engine

    def output_of(self, req: Req) -> ReqOutput | None:
        """What the Engine has not been sent yet (new tokens, the finish reason, prompt logprobs), or None."""
        if req.final_sent:
            return None
        new = req.output_ids[req.sent_len:]
        send_input_lp = req.input_logprobs is not None and not req.input_logprobs_sent
        if not new and not req.finished and not send_input_lp:
            return None
        start = req.sent_len
        out = ReqOutput(
            rid=req.rid, new_ids=new, finish_reason=req.finish_reason,
            prompt_tokens=len(req.input_ids), cached_tokens=max(req.reported_cached, 0),
            cached_details=req.cached_details,
            output_logprobs=req.output_logprobs[start:] if req.return_logprob else [],
            output_top=req.output_top[start:] if req.top_logprobs_num else [],
        )
        if self.cfg.speculative_algorithm != "none":
            out.spec = SpecCounts() if req.spec is None else replace(req.spec.counts)
        if send_input_lp:
            out.input_logprobs, out.input_top = req.input_logprobs, req.input_top
            req.input_logprobs_sent = True
        req.sent_len = len(req.output_ids)
        req.final_sent = req.finished
        return out


def _output_with(req: Req, drafts: list[int]) -> list[int]:
    """The output a row's penalties count: the request's, then the drafts before the row (copied only for a
    request that has a penalty: the sampler reads no other's)."""
    p = req.params
    if not drafts or (p.frequency_penalty == 0.0 and p.presence_penalty == 0.0 and p.repetition_penalty == 1.0):
        return req.output_ids
    return req.output_ids + drafts
