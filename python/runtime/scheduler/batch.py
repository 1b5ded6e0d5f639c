"""One scheduled step: which requests run, how many new tokens each, and the tensors for the model (the
executor's ForwardInput, built here)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from radixgen.runtime.executor.step_messages import ForwardInput

if TYPE_CHECKING:
    from radixgen.runtime.scheduler.request import Req


@dataclass
class Batch:
    """Built by the scheduler once the requests' slots for this step are allocated. Which logits rows the step
    produces (and what each is for) is decided here, at construction, from the requests' state then."""

    reqs: list[Req]
    is_decode: bool
    prefix_lens: list[int]  # kv_len of each request before this step
    extend_lens: list[int]  # new tokens of each request this step
    # a verification (speculative decoding, a decode step): request i computes its last token and drafts[i]
    # (extend_lens[i] == 1 + len(drafts[i])), with logits at each of those rows (from sample_rows[i] on)
    drafts: list[list[int]] | None = None
    # per request: the prompt positions whose logprob this step's logits give (rows lp_first[i] onwards)
    prompt_lp_rows: list[list[int]] = field(init=False)
    lp_first: list[int] = field(init=False)
    # per request: its sampled row in the logits, or -1 (no sampling: a chunk, or nothing left to generate)
    sample_rows: list[int] = field(init=False)
    logit_rows: list[int] = field(init=False)  # (N,) hidden rows -> logits rows, in that order

    def __post_init__(self) -> None:
        self.prompt_lp_rows, self.lp_first, self.sample_rows, self.logit_rows = [], [], [], []
        offset = 0  # the hidden row of request i's first new token
        for i, req in enumerate(self.reqs):
            p, e = self.prefix_lens[i], self.extend_lens[i]
            lp_positions = []
            self.lp_first.append(len(self.logit_rows))
            if req.wants_prompt_logprobs:
                # row r predicts prompt token r + 1; wanted targets are [max(start, 1), len(input))
                lo = max(req.logprob_start_len, 1) - 1
                hi = len(req.input_ids) - 1
                for r in range(max(lo, p), min(hi, p + e)):
                    lp_positions.append(r + 1)
                    self.logit_rows.append(offset + r - p)
            self.prompt_lp_rows.append(lp_positions)
            if self.drafts is not None:
                self.sample_rows.append(len(self.logit_rows))
                self.logit_rows += range(offset, offset + e)
            elif self.completes_prefill(i) and req.params.max_new_tokens > len(req.output_ids):
                self.sample_rows.append(len(self.logit_rows))
                self.logit_rows.append(offset + e - 1)
            else:
                self.sample_rows.append(-1)
            offset += e

    @property
    def num_tokens(self) -> int:
        return sum(self.extend_lens)

    def completes_prefill(self, i: int) -> bool:
        return self.prefix_lens[i] + self.extend_lens[i] == self.reqs[i].seq_len

    def forward_input(self, table: torch.Tensor) -> ForwardInput:
        """The step's tensors; `table` is the request->slot table holding every request's new slots."""
        ids: list[int] = []
        positions: list[int] = []
        slot_parts = []
        for i, req in enumerate(self.reqs):
            p, e = self.prefix_lens[i], self.extend_lens[i]
            # [p, p + e): the positions computed now (a verification's last ones hold the drafts)
            ids += req.fill_ids[p:p + e] if self.drafts is None else req.fill_ids[p:] + self.drafts[i]
            positions += range(p, p + e)
            slot_parts.append(table[req.table_row, p:p + e])
        return ForwardInput(
            input_ids=torch.tensor(ids, dtype=torch.int64),
            positions=torch.tensor(positions, dtype=torch.int64),
            out_slots=torch.cat(slot_parts),
            req_indices=torch.tensor([r.table_row for r in self.reqs], dtype=torch.int64),
            prefix_lens=list(self.prefix_lens),
            extend_lens=list(self.extend_lens),
            logit_rows=torch.tensor(self.logit_rows, dtype=torch.int64),
            verify=self.drafts is not None,
            lora_slots=[r.lora_slot for r in self.reqs] if any(r.lora_slot >= 0 for r in self.reqs) else None,
            media=tuple(r.media for r in self.reqs) if any(r.media for r in self.reqs) else None,
        )
