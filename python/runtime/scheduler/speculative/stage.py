"""The speculative stage of a decode step: draft -> verify (one target forward) -> accept -> free rejected slots.

`draft` turns the scheduler's decode batch into a verification: each request that drafts gets KV slots for its
draft positions (KVCacheManager.extend) and computes its last token plus its drafts in the one forward; the
others ride along as plain decode rows. The output processor then samples every row as the request would
sample there (row j after drafts[:j]: penalties, grammar mask, min_new_tokens, temperature / top-k / top-p /
min-p, one draw of the request's generator per row in order), and `accept` keeps the sampled tokens while the
drafts agree with them: the first disagreement is itself the target's token there. Each kept token is what the
target alone would have drawn with the same draw, so the output's distribution is exactly the target's (the
rejection rule of speculative sampling for deterministic proposals, q one-hot: a draft x is kept with
probability p(x), else the token is drawn from p without x, renormalized), greedy output is the target's own,
and a seeded request's draws are replayed so that it consumes one per kept token, as without speculation.
The scheduler appends the kept tokens one by one through its stop checks and gives back the slots of the
rejected drafts and of those past a stop (KVCacheManager.free_tail): only kept tokens reach the radix tree.
"""

from __future__ import annotations

import logging
import time

import torch

from radixgen.runtime.executor.cpu_decode import MAX_BATCH as MAX_FUSED_ROWS
from radixgen.runtime.executor.cpu_decode import MAX_ROWS_PER_REQUEST
from radixgen.runtime.layers.quantization import weight_bytes
from radixgen.runtime.scheduler.batch import Batch
from radixgen.runtime.scheduler.request import Counters, FinishReason, Req, SpecCounts
from radixgen.runtime.scheduler.speculative.adaptive import ROW_COST, Acceptance, draft_lengths
from radixgen.runtime.scheduler.speculative.draft_model import DraftModelDrafter
from radixgen.runtime.scheduler.speculative.ngram import NgramDrafter

logger = logging.getLogger(__name__)


class RequestSpec:
    """One request's speculative state: its acceptance estimate, its suffix index (ngram), its counts, and its
    generator's state before the verification it is in (seeded sampling requests)."""

    __slots__ = ("acceptance", "index", "counts", "rng_state")

    def __init__(self) -> None:
        self.acceptance = Acceptance()
        self.index = None
        self.counts = SpecCounts()
        self.rng_state: torch.Tensor | None = None


class Speculator:
    def __init__(self, cfg, runner, kv, output, grammar, counters: Counters) -> None:
        self.algorithm = cfg.speculative_algorithm
        self.max_tokens = cfg.num_speculative_tokens
        self.kv, self.output, self.counters = kv, output, counters
        self.context_length = runner.context_length
        # reading one position's K/V for attention, relative to streaming the weights: a row's context cost
        self.kv_cost = runner.kv_cache_info()["bytes_per_token"] / weight_bytes(runner.model)
        # the fused CPU step verifies up to its row limits; past them a verification runs unfused, much slower
        fused = runner.fused_decode is not None
        self.max_rows = MAX_FUSED_ROWS if fused else 1 << 30
        self.max_per_request = min(self.max_tokens, MAX_ROWS_PER_REQUEST - 1) if fused else self.max_tokens
        if self.algorithm == "ngram":
            self.drafter = NgramDrafter(kv)
        else:
            self.drafter = DraftModelDrafter(cfg, runner, output.tokenizer, grammar, output.stop_token_ids)
        self.draft_seconds = 0.0  # spent drafting (a draft model: its forwards, extend steps included)

    # ------------------------------------------------------------------ draft

    def draft(self, batch: Batch) -> Batch:
        """A decode batch (one new slot per request) -> its verification batch, or the batch itself when no
        request drafts. Draft slots come from the free ones: speculation never evicts nor retracts."""
        start = time.perf_counter()
        try:
            return self._draft(batch)
        finally:
            self.draft_seconds += time.perf_counter() - start

    def _draft(self, batch: Batch) -> Batch:
        reqs = batch.reqs
        for req in reqs:
            if req.spec is None:
                req.spec = RequestSpec()
        rooms = [self.room(req, p) if len(reqs) < self.max_rows and not req.spec.acceptance.resting else 0
                 for req, p in zip(reqs, batch.prefix_lens, strict=True)]
        proposals = None
        if not self.drafter.needs_slots:  # proposals first: a request drafts at most what it has
            proposals = [self.propose(req, room) for req, room in zip(reqs, rooms, strict=True)]
            rooms = [len(p) for p in proposals]
        lengths = draft_lengths([r.spec.acceptance.rate for r in reqs], rooms,
                                [ROW_COST + p * self.kv_cost for p in batch.prefix_lens], self.max_rows,
                                self.drafter.forward_cost)
        free = self.kv.free_slots()  # drafts never evict a cached prefix
        for i, req in enumerate(reqs):
            lengths[i] = min(lengths[i], free)
            free -= lengths[i]
            if lengths[i]:
                self.kv.extend(req, lengths[i])
        if proposals is None:  # the draft model drafts now, computing its K/V in those slots
            drafts = self.drafter.draft(batch, lengths)
            for req, n, d in zip(reqs, lengths, drafts, strict=True):
                self.kv.free_tail(req, n - len(d))
        else:
            drafts = [p[:n] for p, n in zip(proposals, lengths, strict=True)]
        if not any(drafts):
            for req in reqs:
                self.record(req, 0, 0)
            return batch
        self.counters.spec_verify_passes += 1
        for req, d in zip(reqs, drafts, strict=True):
            if d and req.generator is not None and not req.params.greedy:
                req.spec.rng_state = req.generator.get_state()
        return Batch(reqs, is_decode=True, prefix_lens=batch.prefix_lens,
                     extend_lens=[1 + len(d) for d in drafts], drafts=drafts)

    def room(self, req: Req, prefix_len: int) -> int:
        """The most a request may draft now: what it may still generate after its next token, and what its
        context has left (its drafts sit at positions prefix_len + 1 ...)."""
        left = req.params.max_new_tokens - len(req.output_ids) - 1
        return max(0, min(self.max_per_request, left, self.context_length - 1 - prefix_len))

    def propose(self, req: Req, room: int) -> list[int]:
        """The drafter's proposal of at most `room` tokens, cut to what is worth verifying; [] when it has none,
        or when proposing failed (logged: drafts only save time, the request goes on without them)."""
        if room <= 0:
            return []
        try:
            return self.allowed(req, self.drafter.propose(req, room))
        except Exception:  # noqa: BLE001 - the request decodes without drafts
            logger.exception("drafting for %s failed; it decodes without drafts this step", req.rid)
            return []

    def allowed(self, req: Req, tokens: list[int]) -> list[int]:
        """The part of a proposal worth verifying: nothing past a stop token, nothing the grammar refuses."""
        stops = self.output.stop_token_ids(req)
        end = next((j + 1 for j, t in enumerate(tokens) if t in stops), len(tokens))
        tokens = tokens[:end]
        if req.grammar is not None and tokens:
            tokens = tokens[:req.grammar.accepted_prefix_len(tokens)]
        return tokens

    def mirror(self, fi) -> None:
        """After an extend step of the target: a draft model computes the same positions' K/V."""
        if self.drafter.needs_slots:
            start = time.perf_counter()
            self.drafter.mirror(fi)
            self.draft_seconds += time.perf_counter() - start

    # ------------------------------------------------------------------ accept

    def accept(self, req: Req, draft: list[int], sampled: list) -> list:
        """The tokens a verification keeps: the sampled token after each draft the target agrees with, up to and
        including the first disagreement (the target's own token there), and after the last draft if all agree.
        A seeded request's generator is left as if it had drawn once per kept token."""
        kept = [sampled[0]]
        for d, s in zip(draft, sampled[1:], strict=True):
            if kept[-1].token != d:
                break
            kept.append(s)
        state = req.spec.rng_state
        if state is not None:
            req.spec.rng_state = None
            req.generator.set_state(state)
            for _ in kept:  # the sampler's draw of a seeded row
                torch.rand((), generator=req.generator)
        return kept

    def keep(self, batch: Batch, i: int, sampled: list) -> FinishReason | None:
        """Request i of a verification after sampling: the tokens it keeps go through the stop checks one by one
        (the finish reason of the first that ends it, or None); the slots of its rejected drafts, and of those
        past a stop, go back."""
        req, draft = batch.reqs[i], batch.drafts[i]
        kept = self.accept(req, draft, sampled)
        reason, taken = self.output.append_tokens(req, kept)
        # positions [p, p + taken) hold its last token and the drafts it kept: the K/V it keeps
        self.kv.free_tail(req, req.kv_len - batch.prefix_lens[i] - taken)
        self.record(req, len(draft), min(taken, len(kept) - 1))
        return reason

    def record(self, req: Req, proposed: int, accepted: int) -> None:
        """After a decode step of a request: its drafts proposed and how many became its output."""
        spec = req.spec
        spec.acceptance.update(proposed, accepted)
        spec.counts.verify_ct += 1
        spec.counts.draft_tokens += proposed
        spec.counts.accepted_tokens += accepted
        self.counters.spec_draft_tokens += proposed
        self.counters.spec_accepted_tokens += accepted

    def info(self) -> dict:
        proposed, accepted = self.counters.spec_draft_tokens, self.counters.spec_accepted_tokens
        return {"algorithm": self.algorithm, "num_speculative_tokens": self.max_tokens,
                "draft_tokens": proposed, "accepted_tokens": accepted,
                "accept_rate": accepted / proposed if proposed else 0.0, "draft_seconds": self.draft_seconds}
