"""How many tokens each request drafts this step: an acceptance estimate per request, and the draft lengths that
pay for their verification rows under a cost model of the step.

A verification forward costs about what a decode step of as many rows does: the weights stream once (the fixed
part, 1 in the units below), and each row adds its share of the matmuls (ROW_COST) and the reading of its
request's context for attention (context length x the KV bytes of one position / the weight bytes). A draft
token that the target accepts with probability g adds g tokens to the step's output; it is worth its row when
the step's tokens per unit of cost go up, i.e. when g > tokens / cost x (the row's cost). So at batch 1 a
draft with a small chance still pays, at batch 8 only likely ones do. A request whose drafts are all rejected
rests for a step, then for twice as many each time it happens again in a row (up to MAX_REST): it probes now
and then, and drafts again as soon as a draft is accepted.
"""

from __future__ import annotations

import heapq

# The matmuls' share of one more row, relative to streaming the weights once. Measured with the fused bf16 step
# here (SmolLM2-135M, 2 threads): 7.7 ms of weights + 0.3 ms per row before attention; a machine's FLOPS to
# bandwidth ratio sets it, not the model (both the weights' bytes and a row's FLOPs scale with the parameters).
ROW_COST = 0.04
PRIOR_HITS, PRIOR_TRIES = 0.5, 1.0  # a new request's drafts are taken to be accepted half the time
DECAY = 0.9  # per step: an estimate reflects about the last ten steps
MAX_REST = 32  # steps without drafts after drafts rejected many times in a row


class Acceptance:
    """One request's estimate of the chance that a draft token is accepted (given the ones before it were), and
    its rest after rejections."""

    __slots__ = ("hits", "tries", "rest", "backoff")

    def __init__(self) -> None:
        self.hits = self.tries = 0.0
        self.rest = self.backoff = 0  # steps left without drafts; the length of the last rest

    @property
    def rate(self) -> float:
        return (self.hits + PRIOR_HITS) / (self.tries + PRIOR_TRIES)

    @property
    def resting(self) -> bool:
        return self.rest > 0

    def update(self, proposed: int, accepted: int) -> None:
        """One step: `accepted` of `proposed` drafts matched; a rejection ends a draft, so the tokens judged
        are the accepted ones and the first rejected one."""
        self.hits = self.hits * DECAY + accepted
        self.tries = self.tries * DECAY + min(proposed, accepted + 1)
        if proposed and not accepted:
            self.backoff = min(2 * self.backoff or 1, MAX_REST)
            self.rest = self.backoff
        else:
            self.backoff = 0 if accepted else self.backoff
            self.rest = max(0, self.rest - 1)


def draft_lengths(rates: list[float], rooms: list[int], row_costs: list[float], max_rows: int,
                  draft_forward_cost: float = 0.0) -> list[int]:
    """How many tokens each request drafts. rates[i]: its acceptance estimate; rooms[i]: the most it may draft;
    row_costs[i]: the cost of one of its rows (ROW_COST + its attention), in units of the step's fixed part;
    max_rows: the most rows the verification may have in all (one per request, plus the drafts).
    draft_forward_cost: a draft model's forward, in the same units: each step of drafting deeper than every
    request before costs one more.

    Greedy over the candidates in order of their chance of being accepted (a request's j-th token: rate^j), each
    taken if it raises the expected tokens per cost of the step."""
    n = len(rates)
    lengths = [0] * n
    tokens = float(n)  # each request's own next token
    cost = 1.0 + sum(row_costs)
    rows, depth = n, 0
    heap = [(-r, i, r) for i, r in enumerate(rates) if rooms[i] > 0]
    heapq.heapify(heap)
    while heap and rows < max_rows:
        neg_gain, i, rate = heapq.heappop(heap)
        gain = -neg_gain
        extra = row_costs[i] + (draft_forward_cost if lengths[i] == depth else 0.0)
        if gain * cost <= tokens * extra:
            continue  # does not pay; nor would this request's next one (a smaller chance, the same cost)
        lengths[i] += 1
        depth = max(depth, lengths[i])
        tokens, cost, rows = tokens + gain, cost + extra, rows + 1
        if lengths[i] < rooms[i]:
            heapq.heappush(heap, (-(gain * rate), i, rate))
    return lengths
