"""The per-step forward context: what attention needs to find a batch's KV, installed with `with`.

The model takes only tensors (token ids, positions); attention layers read the active context to know
where each token's K/V goes in the pool and which slots each request attends to.
"""

from __future__ import annotations

import bisect
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from radixgen.runtime.ground.kv_pool import KVPool


@dataclass
class ForwardContext:
    is_decode: bool  # every request contributes exactly one new token
    kv_pool: KVPool
    out_slots: torch.Tensor  # (T,) slot of each new token's K/V
    req_to_slot: torch.Tensor  # (R, C) the request->slot table
    req_indices: torch.Tensor  # (B,) row of each request in req_to_slot
    prefix_lens: list[int]  # per request: tokens already in the pool before this step
    extend_lens: list[int]  # per request: new tokens in this step (all 1 for decode)
    backend: object  # the ops set's attention backend (torch, CPU or Triton); its `prepare` fills attn_meta
    # Derived once per step (not per layer) by the backend's `prepare`.
    attn_meta: object | None = None
    # Rows of the new tokens whose final hidden states are wanted (those that become logits), or None for all:
    # the last layer then stores K/V for every row but computes attention, MLP and norms for these rows only.
    # The backend's `prepare` keeps it where it computes those rows exactly as it would among all the others
    # (otherwise it sets None) and leaves their attention metadata in rows_meta.
    keep_rows: torch.Tensor | None = None
    rows_meta: object | None = None
    # The step's rows that have a LoRA adapter (lora.pool.LoRABatch: each row's pool slot), read by the LoRA
    # layers around the linear methods; None when no row has one.
    lora: object | None = None
    # a verification of draft tokens (model_runner.ForwardInput.verify): each request's rows are its last token
    # and its drafts, at consecutive positions
    verify: bool = False
    # the window table (ground/window_kv.py): request row, position -> the window group's slot (0: not kept); None
    # where every layer keeps every token
    req_to_wslot: torch.Tensor | None = None

    @property
    def seq_lens(self) -> list[int]:
        return [p + e for p, e in zip(self.prefix_lens, self.extend_lens, strict=True)]

    def kept_row_segments(self) -> tuple[list[int], list[int], list[int]]:
        """keep_rows as extend segments, runs of consecutive rows of one request (in keep_rows' order): each
        segment's request row in req_to_slot, the position of its first row, and its length. Attention over a
        segment is then an extend of `length` tokens after a `position`-token prefix, all already in the pool."""
        starts, total = [], 0
        for e in self.extend_lens:
            starts.append(total)
            total += e
        table_rows = self.req_indices.tolist()
        req_rows, prefixes, lengths = [], [], []
        prev = prev_b = None
        for r in self.keep_rows.tolist():
            b = bisect.bisect_right(starts, r) - 1
            if r - 1 == prev and b == prev_b:
                lengths[-1] += 1
            else:
                req_rows.append(table_rows[b])
                prefixes.append(self.prefix_lens[b] + r - starts[b])
                lengths.append(1)
            prev, prev_b = r, b
        return req_rows, prefixes, lengths


_current: ForwardContext | None = None
_row_kernels = False  # inside `row_kernels()`


@contextmanager
def row_kernels():
    """Inside, kernels whose bits depend on the row count keep to the decode path's kernels at any row count, as
    in a decode step (in_decode_or_verify). The model runner computes a step's logits so, up to the fused decode
    step's batch size: a row's logits then have the fused step's bits whether or not that step took the batch,
    whatever the other rows are."""
    global _row_kernels
    before, _row_kernels = _row_kernels, True
    try:
        yield
    finally:
        _row_kernels = before


@contextmanager
def forward_context(ctx: ForwardContext):
    global _current
    if _current is not None:
        raise RuntimeError("a forward context is already installed; forward passes do not nest")
    _current = ctx
    try:
        yield ctx
    finally:
        _current = None


def in_decode_or_verify() -> bool:
    """Whether the forward being run is a decode step or a verification of draft tokens (not a prefill, not work
    outside a forward such as a vision encoder). Kernels whose bits depend on the row count keep to the decode
    path's kernels there, so that a draft token verified among others gets the bits it would get decoded alone.
    Also true inside `row_kernels()`."""
    return _row_kernels or (_current is not None and (_current.is_decode or _current.verify))


def get_forward_context() -> ForwardContext:
    if _current is None:
        raise RuntimeError("attention ran outside a forward context (use ModelRunner.forward)")
    return _current
