"""The scheduler's record of one request. The messages between the Engine and the scheduler live in
`messages.py` (re-exported here for the modules that import them from this one)."""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch

from radixgen.common.prompt import radix_key
from radixgen.runtime.executor.sampler import make_generator
from radixgen.runtime.messages import (  # noqa: F401 - re-exported
    AbortRequest,
    ControlKind,
    ControlReply,
    ControlRequest,
    FatalError,
    FinishReason,
    GenerateRequest,
    LoadLoRAAdapter,
    LoRAUpdate,
    ReadySignal,
    ReqOutput,
    SpecCounts,
    UnloadLoRAAdapter,
)

# ---------------------------------------------------------------- the request record


@dataclass
class Counters:
    """The scheduler's running totals, one record handed explicitly to each part that counts (intake, output,
    the speculative stage); `as_dict` is what server_info and the metrics read (the speculative counts only when
    speculation is on)."""

    num_requests: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    generation_tokens: int = 0
    forward_passes: int = 0
    extend_passes: int = 0
    decode_passes: int = 0
    retractions: int = 0
    jump_forward_tokens: int = 0
    failed_requests: int = 0
    speculative: bool = False
    spec_draft_tokens: int = 0
    spec_accepted_tokens: int = 0
    spec_verify_passes: int = 0

    def as_dict(self) -> dict[str, int]:
        out = asdict(self)
        if not out.pop("speculative"):
            for name in ("spec_draft_tokens", "spec_accepted_tokens", "spec_verify_passes"):
                del out[name]
        return out


class Req:
    def __init__(self, msg: GenerateRequest, arrival_step: int) -> None:
        self.rid = msg.rid
        self.input_ids = list(msg.input_ids)
        self.media = msg.media
        self.prompt_key = radix_key(self.input_ids, self.media)  # text only: input_ids itself
        self.params = msg.params
        self.kind = msg.kind  # generate, embed or score (runtime/pooling.py); embed and score are prefill-only
        self.pooled: list[float] | None = None  # their result, set by the pooling stage (scheduler/pooling.py)
        self.return_logprob = msg.return_logprob
        self.logprob_start_len = msg.logprob_start_len
        self.top_logprobs_num = msg.top_logprobs_num
        self.namespace = msg.cache_salt  # the LoRA manager composes it with the adapter's (take_in)
        self.lora_name = msg.lora_name  # the adapter asked for (None: the base model)
        self.lora = None  # its lora.manager.AdapterEntry, set at take_in
        self.lora_slot = -1  # the pool slot it holds while admitted (-1: none)
        self.arrival_step = arrival_step
        self.output_ids: list[int] = []
        self.generator: torch.Generator | None = (
            make_generator(msg.params.seed) if msg.params.seed is not None else None
        )
        self.grammar = None  # a matcher when the request is constrained
        self.waits: list = []  # conditions pending before admission (scheduler/waits.py)
        self.regex_stop = None  # scheduler.output.RegexStop when params.stop_regex is set
        self.spec = None  # speculative.RequestSpec with speculative decoding on (its drafting state and counts)

        # KV state, written by the KV cache manager only: positions [0, cached_len) are held by the tree under
        # last_node (locked); [cached_len, kv_len) are slots this request owns (from the step that computes them
        # on); all are listed in its table row.
        self.table_row: int | None = None
        self.kv_len = 0
        self.cached_len = 0
        self.last_node = None
        self.reported_cached = -1  # cached prompt tokens at first admission
        self.cached_details: dict | None = None  # with the hierarchical cache: reported_cached by tier
        self.kv_load = None  # a load-back from the hierarchical cache's lower tiers in progress (tiers.Load)
        self.tier_loaded: tuple[int, int, int] | None = None  # its last one: (device prefix, host, disk tokens)
        self.tier_prefetched = 0  # tokens of it in the pool, loaded for this request before its admission
        self.tier_hold = None  # the tree node that prefix is locked under for it until it gets slots of its own
        self.tier_reserved = 0  # pool slots its load-back counted on for its prefill until then

        self.finish_reason: FinishReason | None = None  # set by the scheduler's finish(), which reports it
        self.to_abort: str | None = None
        self.sent_len = 0  # output tokens already sent to the Engine
        self.final_sent = False  # the finish reason was sent: nothing more goes out
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
    def radix_key(self) -> list[int]:
        """The tree's key of fill_ids: each media span's ids replaced by its content hash's (common.prompt)."""
        return self.prompt_key + self.output_ids

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
