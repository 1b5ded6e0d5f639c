"""Drafts from a small model of the same vocabulary, run autoregressively for a few tokens per step.

The draft model has its own runner and KV pool, with as many slots as the target's and the target's own
request->slot table: a position's slot is the same in both pools, so the radix tree's slots serve both models.
That holds because the draft computes the K/V of every position the target keeps: each extend step of the
target is run on the draft too (`mirror`), and a decode step's drafting computes the request's last token and,
for k drafts, the first k of them (k + 1 forwards), which covers every position a verification can keep (its
last token and the accepted drafts; the target's own next token is computed by the next step, in both models).
"""

from __future__ import annotations

import dataclasses

import torch

from radixgen.runtime.executor.step_messages import ForwardInput
from radixgen.runtime.layers.quantization import weight_bytes
from radixgen.runtime.scheduler.batch import Batch


class DraftModelDrafter:
    needs_slots = True  # computes K/V in the slots of the positions it drafts

    def __init__(self, cfg, target, tokenizer, grammar, stop_token_ids) -> None:
        """cfg: the target's RuntimeConfig (its speculative_draft_model is loaded); target: its ModelRunner;
        tokenizer: the target's, which the draft model's must equal; stop_token_ids(req): the ids that end a
        request (no draft goes past one)."""
        from radixgen.runtime.executor.model_runner import ModelRunner
        from radixgen.runtime.loader import load_tokenizer

        if load_tokenizer(cfg.speculative_draft_model).get_vocab() != tokenizer.get_vocab():
            raise ValueError(f"speculative_draft_model {cfg.speculative_draft_model!r}: its tokenizer's vocabulary "
                             "differs from the target model's; a draft model must share the target's vocabulary")
        # the draft model drafts with its own weights only: a request's LoRA adapter is the target's, whose
        # verification keeps exactly the target's (adapted) tokens whatever the draft proposes
        draft_cfg = dataclasses.replace(cfg, model=cfg.speculative_draft_model, speculative_algorithm="none",
                                        speculative_draft_model=None, enable_lora=False, lora_paths=(),
                                        context_length=target.context_length,
                                        max_total_tokens=target.kv_pool.num_slots - 1)
        try:
            self.runner = ModelRunner(draft_cfg, req_to_slot=target.req_to_slot)
        except ValueError as e:  # (the draft takes the target's weight format, dtype and device)
            kind = type(e) if type(e).__init__ is ValueError.__init__ else ValueError
            raise kind(f"speculative_draft_model {cfg.speculative_draft_model!r}, loaded with the target's "
                          f"quantization={cfg.quantization!r}: {e}") from e
        self.vocab_size = min(self.runner.vocab_size, target.vocab_size)  # beyond: padding rows of either model
        self.grammar = grammar
        self.stop_token_ids = stop_token_ids
        # a draft forward's cost relative to the target's fixed part (both stream their weights)
        self.forward_cost = weight_bytes(self.runner.model) / weight_bytes(target.model)

    def mirror(self, fi: ForwardInput) -> None:
        """The draft's K/V of an extend step the target just ran (its logits are not needed)."""
        self.runner.forward(fi._replace(logit_rows=fi.logit_rows[:0], lora_slots=None))

    def draft(self, batch: Batch, lengths: list[int]) -> list[list[int]]:
        """Up to lengths[i] greedy draft tokens for each request of a decode batch, whose slots for positions
        [p, p + 1 + lengths[i]) are allocated (p: its prefix length). The forward at depth t computes position
        p + t (the last token, then draft t) of the requests that reached it and gives their draft t + 1; a
        draft that ends the request (a stop token, the grammar's end) needs no K/V. Grammars mask each draft's
        logits; the matchers are back where they were at the end."""
        reqs, table = batch.reqs, self.runner.req_to_slot
        drafts: list[list[int]] = [[] for _ in reqs]
        active = list(range(len(reqs)))  # the requests whose position p + depth is computed at this depth
        depth = 0
        try:
            while active:
                want = [k for k, i in enumerate(active) if len(drafts[i]) < lengths[i]]  # rows drafting on
                pos = [batch.prefix_lens[i] + depth for i in active]
                rows = torch.tensor([reqs[i].table_row for i in active], dtype=torch.int64)
                fi = ForwardInput(
                    input_ids=torch.tensor([drafts[i][-1] if depth else reqs[i].output_ids[-1] for i in active]),
                    positions=torch.tensor(pos), out_slots=table[rows, torch.tensor(pos)], req_indices=rows,
                    prefix_lens=pos, extend_lens=[1] * len(active), logit_rows=torch.tensor(want, dtype=torch.int64))
                logits = self.runner.forward(fi)
                going = []
                for k, tok in zip(want, self.pick([reqs[active[k]] for k in want], logits), strict=True):
                    i = active[k]
                    m = reqs[i].grammar
                    if tok is None or (m is not None and not m.accept_token(tok)):
                        continue  # the grammar allows nothing here: the draft ends
                    drafts[i].append(tok)
                    if tok not in self.stop_token_ids(reqs[i]) and (m is None or not m.is_terminated()):
                        going.append(i)
                active, depth = going, depth + 1
        finally:
            for req, d in zip(reqs, drafts, strict=True):
                if req.grammar is not None:
                    req.grammar.rollback(len(d))
        return drafts

    def pick(self, reqs: list, logits: torch.Tensor) -> list[int | None]:
        """The argmax of each row (None where the request's grammar, in its current state, allows nothing)."""
        if not reqs:
            return []
        apply_mask = self.grammar.mask_fn(reqs) if self.grammar is not None else None
        if apply_mask is not None:
            short = self.grammar.vocab_size - logits.shape[1]  # a draft model with less padding than the target
            # a copy: the forward's output is an inference tensor, not to be edited in place
            logits = torch.nn.functional.pad(logits, (0, max(short, 0)), value=float("-inf"))
            apply_mask(logits)
        best, ids = logits[:, :self.vocab_size].max(dim=-1)
        return [None if b == float("-inf") else t for b, t in zip(best.tolist(), ids.tolist(), strict=True)]
