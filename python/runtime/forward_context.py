"""The per-step forward context: what attention needs to find a batch's KV, installed with `with`.

The model takes only tensors (token ids, positions); attention layers read the active context to know
where each token's K/V goes in the pool and which slots each request attends to.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass

import torch

from radixgen.runtime.kv_pool import KVPool


@dataclass
class ForwardContext:
    is_decode: bool  # every request contributes exactly one new token
    kv_pool: KVPool
    out_slots: torch.Tensor  # (T,) slot of each new token's K/V
    req_to_slot: torch.Tensor  # (R, C) the request->slot table
    req_indices: torch.Tensor  # (B,) row of each request in req_to_slot
    prefix_lens: list[int]  # per request: tokens already in the pool before this step
    extend_lens: list[int]  # per request: new tokens in this step (all 1 for decode)
    backend: object  # the attention backend (torch or Triton); its `prepare` fills attn_meta
    # Derived once per step (not per layer) by the backend's `prepare`.
    attn_meta: object | None = None

    @property
    def seq_lens(self) -> list[int]:
        return [p + e for p, e in zip(self.prefix_lens, self.extend_lens, strict=True)]


_current: ForwardContext | None = None


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


def get_forward_context() -> ForwardContext:
    if _current is None:
        raise RuntimeError("attention ran outside a forward context (use ModelRunner.forward)")
    return _current
