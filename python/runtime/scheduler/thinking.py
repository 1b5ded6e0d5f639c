"""The thinking budget (SamplingParams.max_thinking_tokens): which token a request must sample next so that
its think block closes within the budget.

The output begins inside the block. If the block's closing text is not in the first `budget` output
tokens, the closing text's tokens are forced at positions [budget, budget + len(end)); after that the
answer is sampled freely (or under its grammar's part after the block). Only those len(end) steps look at
the output (one decode of its first `budget` tokens), so the check costs nothing in the other steps."""

from __future__ import annotations

from collections.abc import Sequence
from functools import lru_cache


class ThinkingBudget:
    """The scheduler's owner of the closing tokens of each think_end text (tokenized once)."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.end_ids = lru_cache(maxsize=64)(self._end_ids)

    def _end_ids(self, end: str) -> tuple[int, ...]:
        return tuple(self.tokenizer.encode(end, add_special_tokens=False))

    def forced(self, params, output_ids: Sequence[int]) -> int | None:
        """The token forced at position len(output_ids), or None (the request samples as usual)."""
        budget = params.max_thinking_tokens
        if budget is None or len(output_ids) < budget:
            return None
        end = self.end_ids(params.think_end)
        k = len(output_ids) - budget  # [0, len(end)): the k-th closing token is due, unless closed already
        if k >= len(end):
            return None
        if params.think_end in self.tokenizer.decode(list(output_ids[:budget]), skip_special_tokens=False):
            return None  # the model closed the block itself within the budget
        return end[k]
