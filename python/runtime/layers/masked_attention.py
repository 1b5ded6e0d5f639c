"""Attention variants the pool kernels do not run: a sliding window (a query sees only the last `window`
positions, itself included), a soft-cap on the logits (cap * tanh(s / cap), Gemma 2) and attention sinks (a
learned logit per query head that joins the softmax's denominator and adds nothing to the output, gpt-oss).

Plain torch over the paged pool, on every device: the new tokens' K/V are stored as the backends store them
(8-bit pools quantized), then each request's queries attend to the pool rows of the positions they may see,
read through the slot table. A window layer reads only the rows of its last `window` positions (its cost per
token is bounded by the window). Where the pool keeps a window group (ground/window_kv.py) a window layer's rows
are window slots, read through the window table, in which the positions a query may see always point at live
rows; elsewhere every layer keeps every token and the window is a mask only.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from radixgen.kernels.kv_quant import gather_rows, store_rows_ref
from radixgen.runtime.ground.forward_context import ForwardContext


class AttentionVariant(NamedTuple):
    """window: a query at position i sees positions (i - window, i] (0: every earlier position); softcap: logits
    become softcap * tanh(logits / softcap) (None: none); sinks: (H,) this rank's per-head sink logits (None)."""

    window: int = 0
    softcap: float | None = None
    sinks: torch.Tensor | None = None

    def describe(self) -> str | None:
        """What makes this attention a variant, in words (None: plain causal attention)."""
        parts = ([f"a sliding window of {self.window}"] if self.window else []) + \
            ([f"logit soft-capping at {self.softcap}"] if self.softcap is not None else []) + \
            (["attention sinks"] if self.sinks is not None else [])
        return ", ".join(parts) or None


class StepSpan(NamedTuple):  # one request's rows in a step
    q_start: int
    q_end: int
    table_row: int
    prefix_len: int


def step_spans(ctx: ForwardContext) -> list[StepSpan]:
    """The step's requests (derived once per step, not once per layer)."""
    cached = getattr(ctx, "_masked_spans", None)
    if cached is not None:
        return cached
    spans, start = [], 0
    for row, p, e in zip(ctx.req_indices.tolist(), ctx.prefix_lens, ctx.extend_lens, strict=True):
        spans.append(StepSpan(start, start + e, row, p))
        start += e
    ctx._masked_spans = spans
    return spans


def window_out_slots(ctx: ForwardContext) -> torch.Tensor:
    """(T,) the window slot of each new token (the window table's entries of the step's positions), once a step."""
    cached = getattr(ctx, "_window_out_slots", None)
    if cached is not None:
        return cached
    parts = [ctx.req_to_wslot[s.table_row, s.prefix_len:s.prefix_len + s.q_end - s.q_start] for s in step_spans(ctx)]
    out = torch.cat(parts).to(torch.int64) if parts else ctx.out_slots.to(torch.int64)[:0]
    if bool((out == 0).any()):
        raise RuntimeError("masked_attention: a new token of a window layer has no window slot")
    ctx._window_out_slots = out
    return out


def masked_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int, scale: float,
                     variant: AttentionVariant, ctx: ForwardContext) -> torch.Tensor:
    """q (T, H, D), k / v (T, Hkv, D) of the step's new tokens -> (T, H, D). Stores k / v in the pool first."""
    kv = ctx.kv_pool.layer(layer_id)
    windowed = ctx.req_to_wslot is not None and ctx.kv_pool.windowed(layer_id)
    table = ctx.req_to_wslot if windowed else ctx.req_to_slot
    slots = window_out_slots(ctx) if windowed else ctx.out_slots.to(torch.int64)
    store_rows_ref(kv.k, kv.k_scales, slots, k)
    store_rows_ref(kv.v, kv.v_scales, slots, v)
    h, hkv = q.shape[1], k.shape[1]
    out = torch.empty_like(q)
    for span in step_spans(ctx):
        e = span.q_end - span.q_start
        if e == 0:
            continue
        end = span.prefix_len + e  # positions [0, end) are in the pool now
        first = max(0, span.prefix_len - variant.window + 1) if variant.window else 0
        # [first, end): the positions some query of this span may see
        rows = table[span.table_row, first:end].to(torch.int64)
        if windowed and bool((rows == 0).any()):  # the KV manager keeps them: a miss is its bug, not a wrong answer
            raise RuntimeError(f"masked_attention: the window table misses positions of [{first}, {end})")
        ks = gather_rows(kv.k, kv.k_scales, rows, torch.float32)  # (L, Hkv, D)
        vs = gather_rows(kv.v, kv.v_scales, rows, torch.float32)
        qs = q[span.q_start:span.q_end].float().transpose(0, 1)  # (H, E, D)
        ks = ks.transpose(0, 1).repeat_interleave(h // hkv, dim=0)  # (H, L, D)
        vs = vs.transpose(0, 1).repeat_interleave(h // hkv, dim=0)
        logits = torch.matmul(qs, ks.transpose(1, 2)) * scale  # (H, E, L)
        if variant.softcap is not None:
            logits = torch.tanh(logits / variant.softcap) * variant.softcap
        q_pos = torch.arange(span.prefix_len, end, device=q.device).unsqueeze(1)  # (E, 1)
        k_pos = torch.arange(first, end, device=q.device).unsqueeze(0)  # (1, L)
        hidden = k_pos > q_pos
        if variant.window:
            hidden |= k_pos <= q_pos - variant.window
        logits = logits.masked_fill(hidden, float("-inf"))
        if variant.sinks is not None:  # one more column per head: the sink, dropped after the softmax
            sink = variant.sinks.float().view(h, 1, 1).expand(h, e, 1)
            probs = torch.softmax(torch.cat([logits, sink], dim=-1), dim=-1)[..., :-1]
        else:
            probs = torch.softmax(logits, dim=-1)
        out[span.q_start:span.q_end] = torch.matmul(probs, vs).transpose(0, 1).to(q.dtype)
    return out
