"""The scheduler's record of one request, and the messages between the Engine and the scheduler."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from radixgen.runtime.sampler import make_generator
from radixgen.runtime.sampling_params import SamplingParams

# ---------------------------------------------------------------- messages (pickled over zmq)


@dataclass
class GenerateRequest:
    rid: str
    input_ids: list[int]
    params: SamplingParams
    return_logprob: bool = False
    logprob_start_len: int = -1
    top_logprobs_num: int = 0
    cache_salt: str | None = None


@dataclass
class AbortRequest:
    rid: str


@dataclass
class ControlRequest:
    """A request answered by a `ControlReply` with the same id: flush_cache, server_info, shutdown."""

    reply_id: int
    kind: str


@dataclass
class ControlReply:
    reply_id: int
    payload: Any


@dataclass
class ReqOutput:
    """What one step produced for one request (only the new part)."""

    rid: str
    new_ids: list[int]
    finish_reason: dict | None
    prompt_tokens: int
    cached_tokens: int
    output_logprobs: list[float] = field(default_factory=list)
    output_top: list[tuple[list[float], list[int]]] = field(default_factory=list)
    input_logprobs: list[float | None] | None = None  # sent once, when complete
    input_top: list[tuple[list[float], list[int]] | None] | None = None


@dataclass
class FatalError:
    message: str


# ---------------------------------------------------------------- the request record


class Req:
    def __init__(self, msg: GenerateRequest, arrival_step: int) -> None:
        self.rid = msg.rid
        self.input_ids = list(msg.input_ids)
        self.params = msg.params
        self.return_logprob = msg.return_logprob
        self.logprob_start_len = msg.logprob_start_len
        self.top_logprobs_num = msg.top_logprobs_num
        self.namespace = msg.cache_salt
        self.arrival_step = arrival_step
        self.output_ids: list[int] = []
        self.generator: torch.Generator | None = (
            make_generator(msg.params.seed) if msg.params.seed is not None else None
        )
        self.grammar = None  # a matcher when the request is constrained
        self.grammar_future = None

        # KV state: positions [0, cached_len) are held by the tree under last_node (locked);
        # [cached_len, kv_len) are slots this request owns; all are listed in its table row.
        self.table_row: int | None = None
        self.kv_len = 0
        self.cached_len = 0
        self.last_node = None
        self.reported_cached = -1  # cached prompt tokens at first admission

        self.finish_reason: dict | None = None
        self.to_abort: str | None = None
        self.sent_len = 0  # output tokens already sent to the Engine
        self.output_logprobs: list[float] = []
        self.output_top: list[tuple[list[float], list[int]]] = []
        self.input_logprobs: list[float | None] | None = None
        self.input_top: list | None = None
        self.input_logprobs_sent = False
        self.pending_input_lp: dict[int, tuple[float, tuple | None]] = {}

    @property
    def fill_ids(self) -> list[int]:
        return self.input_ids + self.output_ids

    @property
    def seq_len(self) -> int:
        return len(self.input_ids) + len(self.output_ids)

    @property
    def remaining_prefill(self) -> int:
        """Tokens still to compute before this request can sample."""
        return self.seq_len - self.kv_len

    @property
    def wants_prompt_logprobs(self) -> bool:
        return self.return_logprob and self.logprob_start_len >= 0 and self.input_logprobs is None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def max_cacheable(self) -> int:
        """How much of fill_ids may come from the tree: at least one token is computed (for logits),
        and prompt positions whose logprobs are wanted need the logits of the position before them."""
        limit = self.seq_len - 1
        if self.wants_prompt_logprobs:
            limit = min(limit, max(self.logprob_start_len - 1, 0))
        return max(limit, 0)
