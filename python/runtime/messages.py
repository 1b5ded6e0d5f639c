"""The messages between the Engine and the scheduler process (pickled over zmq): small typed records only.

Engine -> scheduler: `GenerateRequest`, `AbortRequest`, `ControlRequest`, `LoadLoRAAdapter`,
`UnloadLoRAAdapter`, `TreeSnapshotRequest`.
Scheduler -> Engine: `ReadySignal` (once, at start), `ReqOutput` (per step and request), `ControlReply`
(a `LoRAUpdate` for the LoRA messages, a `TreeSnapshot` for a snapshot request), `FatalError` (the
scheduler cannot go on).
The messages between the ranks of a parallel group are in step_messages.py (they name scheduler records; this
module imports none).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Literal

from radixgen.common.prompt import MediaItem
from radixgen.common.sampling_params import SamplingParams
from radixgen.runtime.pooling import RequestKind

FinishKind = Literal["stop", "length", "abort"]


@dataclass(frozen=True)
class FinishReason:
    """Why a request ended.

    stop: `matched` is the stop token id, the stop string or the text the stop regex matched (None when a
    grammar terminated). length: `length` tokens were generated. abort: `message` says why; `status_code` is
    set when the request itself was at fault (400) and `fatal` when the runtime can no longer serve.
    """

    kind: FinishKind
    matched: int | str | None = None
    length: int | None = None
    message: str | None = None
    status_code: int | None = None
    fatal: bool = False

    def __post_init__(self) -> None:
        if self.kind not in ("stop", "length", "abort"):
            raise ValueError(f"unknown finish kind {self.kind!r}")

    @classmethod
    def stop(cls, matched: int | str | None) -> FinishReason:
        return cls("stop", matched=matched)

    @classmethod
    def length_limit(cls, length: int) -> FinishReason:
        return cls("length", length=length)

    @classmethod
    def abort(cls, message: str, status_code: int | None = None, fatal: bool = False) -> FinishReason:
        return cls("abort", message=message, status_code=status_code, fatal=fatal)

    @property
    def is_request_error(self) -> bool:
        """An abort caused by the request itself (the caller gets a 400 / RequestError)."""
        return self.kind == "abort" and self.status_code == 400

    def to_json(self) -> dict[str, Any]:
        """The wire shape (native API `meta_info.finish_reason`): {"type": kind, ...}; the one place it is built."""
        if self.kind == "stop":
            return {"type": "stop", "matched": self.matched}
        if self.kind == "length":
            return {"type": "length", "length": self.length}
        out: dict[str, Any] = {"type": "abort", "message": self.message}
        if self.status_code is not None:
            out["status_code"] = self.status_code
        if self.fatal:
            out["fatal"] = True
        return out


# ---------------------------------------------------------------- Engine -> scheduler


@dataclass
class GenerateRequest:
    rid: str
    input_ids: list[int]
    params: SamplingParams
    return_logprob: bool = False
    logprob_start_len: int = -1
    top_logprobs_num: int = 0
    cache_salt: str | None = None
    lora_name: str | None = None  # a LoRA adapter's name (None: the base model)
    media: tuple[MediaItem, ...] = ()  # the prompt's media items, each over its span of input_ids
    # generate: sample tokens; embed: pool the prompt's final hidden states into one vector; score: a reranker's
    # relevance logits of the prompt (runtime/pooling.py). embed and score requests are prefill-only.
    kind: RequestKind = "generate"
    token_type_ids: list[int] | None = None  # an encoder's segment ids (a cross-encoder's query / document)


@dataclass
class AbortRequest:
    rid: str


class ControlKind(str, Enum):
    FLUSH_CACHE = "flush_cache"  # reply: True, or False when requests are running
    SERVER_INFO = "server_info"  # reply: a dict (cache usage, queue lengths, stats)
    SHUTDOWN = "shutdown"  # reply: True, then the process exits


@dataclass
class ControlRequest:
    """A request answered by a `ControlReply` with the same id. `kind` may be given as its string value."""

    reply_id: int
    kind: ControlKind

    def __post_init__(self) -> None:
        self.kind = ControlKind(self.kind)  # ValueError names an unknown kind


@dataclass
class LoadLoRAAdapter:
    """Register the PEFT adapter folder `path` under `name` (read off the scheduler's loop); answered by a
    ControlReply with the same id whose payload is a LoRAUpdate. A pinned adapter is never replaced."""

    reply_id: int
    name: str
    path: str
    pinned: bool = False


@dataclass
class UnloadLoRAAdapter:
    """Forget the adapter `name` (requests in flight for it finish); answered by a LoRAUpdate."""

    reply_id: int
    name: str


@dataclass
class TreeSnapshotRequest:
    """Ask for a bounded picture of the radix tree (scheduler/radix/snapshot.py), answered by a ControlReply with
    the same id whose payload is a TreeSnapshot: the `max_nodes` largest subtrees, `max_depth` edges deep at most,
    each edge with a preview of its first `preview_chars` characters. `viewer`: the cache namespace of the API key
    asking under per-key isolation (it sees only its own namespaces); None: every namespace (shared cache)."""

    reply_id: int
    max_nodes: int
    max_depth: int
    preview_chars: int
    viewer: str | None = None


# ---------------------------------------------------------------- scheduler -> Engine


@dataclass(frozen=True)
class TreeNodeView:
    """One edge of the radix tree as the console draws it. `parent` is None for an edge right under its
    namespace's root; `text` is None where the viewer may not read it (another client's salted namespace)."""

    id: int
    parent: int | None
    namespace: str  # a display label, never a raw cache salt
    depth: int  # edges above it in its namespace
    prefix_len: int  # tokens before this edge
    tokens: int  # tokens on this edge
    subtree_tokens: int  # this edge's and every edge's below it
    hits: int  # requests admitted with a cached prefix through this edge
    idle_ticks: int  # tree operations (matches, inserts) since its last use
    locked: bool  # held by a running request
    hidden_children: int  # children left out of the snapshot (the size and depth bounds)
    text: str | None


@dataclass(frozen=True)
class TreeSnapshot:
    """A bounded picture of the radix tree: the largest subtrees first, namespaces apart (see TreeNodeView)."""

    nodes: list[TreeNodeView]
    total_nodes: int  # edges the viewer may see, in the snapshot or not
    total_tokens: int  # tokens in them
    namespaces: list[str]  # the labels of the namespaces the viewer may see, largest first
    page_size: int

    def to_json(self) -> dict[str, Any]:
        return {"nodes": [vars(n) for n in self.nodes], "total_nodes": self.total_nodes,
                "total_tokens": self.total_tokens, "namespaces": self.namespaces, "page_size": self.page_size,
                "truncated": len(self.nodes) < self.total_nodes}



@dataclass
class LoRAUpdate:
    """The answer to a LoRA load or unload: `error` None on success, else what was wrong; the adapters loaded
    after it (name -> path) either way."""

    error: str | None
    adapters: dict[str, str]


@dataclass
class ReadySignal:
    """Sent once when the scheduler process has built everything."""

    num_slots: int  # KV pool capacity in tokens
    context_length: int
    vocab_size: int
    dtype: str
    max_running_requests: int
    grammar: bool  # constrained decoding available
    lora_adapters: dict[str, str] | None = None  # the LoRA adapters loaded at start (name -> path); None: no LoRA


@dataclass
class ControlReply:
    reply_id: int
    payload: Any


@dataclass
class SpecCounts:
    """A request's speculative decoding so far (cumulative): decode steps it took part in (each one verification
    forward), draft tokens proposed for it, and how many of those became its output."""

    verify_ct: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0


@dataclass
class ReqOutput:
    """What one step produced for one request (only the new part)."""

    rid: str
    new_ids: list[int]
    finish_reason: FinishReason | None
    prompt_tokens: int
    cached_tokens: int
    output_logprobs: list[float] = field(default_factory=list)
    output_top: list[tuple[list[float], list[int]]] = field(default_factory=list)
    input_logprobs: list[float | None] | None = None  # sent once, when complete
    input_top: list[tuple[list[float], list[int]] | None] | None = None
    # the refusal of a second request under a rid already in flight: it is not about the request in flight
    duplicate: bool = False
    spec: SpecCounts | None = None  # with speculative decoding on: the request's counts so far
    cached_details: dict | None = None  # with the hierarchical cache: cached_tokens by tier (device / host / disk)
    pooled: list[float] | None = None  # an embed request's vector (not normalised) or a score request's logits


@dataclass
class FatalError:
    message: str
