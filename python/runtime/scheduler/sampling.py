"""Sampling a step's logits rows into tokens, as the requests' state constrains them: stop tokens held back before
min_new_tokens, a think block closed at its budget (thinking.py), the grammar's bitmask, penalties over the output so
far (a verification's drafts included), then the executor's Sampler (temperature / top-k / top-p / min-p)."""

from __future__ import annotations

import logging
from typing import NamedTuple

import torch

from radixgen.runtime.executor.sampler import Sampler, SamplingBatch
from radixgen.runtime.executor.sampler_rows import BatchInvariantRows
from radixgen.runtime.scheduler.batch import Batch
from radixgen.runtime.scheduler.request import Req
from radixgen.runtime.scheduler.thinking import ThinkingBudget

logger = logging.getLogger(__name__)


class Sampled(NamedTuple):
    token: int
    logprob: float | None
    top: tuple[list[float], list[int]] | None


class StepSampler:
    def __init__(self, tokenizer, grammar, vocab_size: int, eos_ids: set[int], batch_invariant: bool = False) -> None:
        """batch_invariant: the sampler's reductions on the row kernels (the deterministic mode on CUDA)."""
        self.grammar = grammar
        self.vocab_size = vocab_size
        self.eos_ids = eos_ids
        self.sampler = Sampler(rows=BatchInvariantRows()) if batch_invariant else Sampler()
        self.thinking = ThinkingBudget(tokenizer)

    def stop_token_ids(self, req: Req) -> set[int]:
        ids = set(req.params.stop_token_ids)
        if not req.params.ignore_eos:
            ids |= self.eos_ids
        return ids

    def sample(self, batch: Batch, logits: torch.Tensor) -> tuple[dict[int, list[Sampled]], dict[int, Exception]]:
        """The sampled tokens of each request (by batch index) that samples this step, one per logits row it has
        (a verification's request: one after its last token and one after each draft), and the requests whose
        sampling failed. A failure of the batched call is retried request by request, so it fails only the
        requests that cause it."""
        # an embed / score request's last prompt row is read by the pooling stage, never sampled
        idx = [i for i, row in enumerate(batch.sample_rows) if row >= 0 and batch.reqs[i].kind == "generate"]
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


def _output_with(req: Req, drafts: list[int]) -> list[int]:
    """The output a row's penalties count: the request's, then the drafts before the row (copied only for a
    request that has a penalty: the sampler reads no other's)."""
    p = req.params
    if not drafts or (p.frequency_penalty == 0.0 and p.presence_penalty == 0.0 and p.repetition_penalty == 1.0):
        return req.output_ids
    return req.output_ids + drafts
