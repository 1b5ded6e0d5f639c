"""One scheduled step: which requests run, how many new tokens each, and the tensors for the model."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from radixgen.runtime.model_runner import ForwardInput
from radixgen.runtime.request import Req


@dataclass
class Batch:
    reqs: list[Req]
    is_decode: bool
    prefix_lens: list[int]  # kv_len of each request before this step
    extend_lens: list[int]  # new tokens of each request this step
    # per request: (logits-row offset, prompt positions whose logprob the rows give), filled by build
    prompt_lp_rows: list[list[int]] = field(default_factory=list)
    sample_rows: list[int] = field(default_factory=list)  # index into logits, or -1: no sampling

    @property
    def num_tokens(self) -> int:
        return sum(self.extend_lens)

    def completes_prefill(self, i: int) -> bool:
        return self.prefix_lens[i] + self.extend_lens[i] == self.reqs[i].seq_len

    def forward_input(self, table: torch.Tensor) -> ForwardInput:
        ids: list[int] = []
        positions: list[int] = []
        logit_rows: list[int] = []
        slot_parts = []
        self.prompt_lp_rows, self.sample_rows = [], []
        offset = 0
        for i, req in enumerate(self.reqs):
            p, e = self.prefix_lens[i], self.extend_lens[i]
            # [p, p + e): the positions computed now
            ids += req.fill_ids[p:p + e]
            positions += range(p, p + e)
            slot_parts.append(table[req.table_row, p:p + e])
            lp_positions = []
            if req.wants_prompt_logprobs:
                # row r predicts prompt token r + 1; wanted targets are [max(start, 1), len(input))
                lo = max(req.logprob_start_len, 1) - 1
                hi = len(req.input_ids) - 1
                for r in range(max(lo, p), min(hi, p + e)):
                    lp_positions.append(r + 1)
                    logit_rows.append(offset + r - p)
            self.prompt_lp_rows.append(lp_positions)
            if self.completes_prefill(i) and req.params.max_new_tokens > len(req.output_ids):
                self.sample_rows.append(len(logit_rows))
                logit_rows.append(offset + e - 1)
            else:
                self.sample_rows.append(-1)
            offset += e
        return ForwardInput(
            input_ids=torch.tensor(ids, dtype=torch.int64),
            positions=torch.tensor(positions, dtype=torch.int64),
            out_slots=torch.cat(slot_parts),
            req_indices=torch.tensor([r.table_row for r in self.reqs], dtype=torch.int64),
            prefix_lens=list(self.prefix_lens),
            extend_lens=list(self.extend_lens),
            logit_rows=torch.tensor(logit_rows, dtype=torch.int64),
        )
