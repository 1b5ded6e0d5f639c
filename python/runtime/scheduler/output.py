"""Output processing, one request at a time: the sampled tokens appended (sampling.py samples them), grammar advance
and jump-forward, stop conditions, logprobs, and the `ReqOutput` record each step sends to the Engine.

Nothing here finishes a request: the checks return a `FinishReason` and the scheduler's `finish` (which always
emits) applies it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import replace

import torch

from radixgen.common.stop_regex import StopRegexMatcher
from radixgen.runtime.config import RuntimeConfig
from radixgen.runtime.detokenizer import IncrementalDetokenizer
from radixgen.runtime.executor.prompt_logprobs import prompt_logprobs
from radixgen.runtime.scheduler.batch import Batch
from radixgen.runtime.scheduler.request import Counters, FinishReason, Req, ReqOutput, SpecCounts
from radixgen.runtime.scheduler.sampling import Sampled

logger = logging.getLogger(__name__)


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
    def __init__(self, cfg: RuntimeConfig, tokenizer, grammar, vocab_size: int,
                 stop_token_ids: Callable[[Req], set[int]], context_length: int, counters: Counters) -> None:
        self.cfg = cfg
        self.tokenizer = tokenizer
        self.grammar = grammar
        self.vocab_size = vocab_size
        self.stop_token_ids = stop_token_ids  # the sampler's (sampling.py): the request's stop ids and the EOS ids
        self.context_length = context_length
        self.counters = counters

    # ------------------------------------------------------------------ tokens

    def append_token(self, req: Req, s: Sampled) -> FinishReason | None:
        """Append a sampled token; advance the grammar (and jump forward). A grammar rejection finishes."""
        req.output_ids.append(s.token)
        self.counters.generation_tokens += 1
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
            self.counters.jump_forward_tokens += 1
            if req.return_logprob:
                req.output_logprobs.append(0.0)
                if req.top_logprobs_num:
                    req.output_top.append(([0.0], [tok]))

    # ------------------------------------------------------------------ stop conditions

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
