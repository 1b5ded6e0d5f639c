"""Attention over the paged KV pool: store this step's K/V by slot, then attend through the slot table.

Three backends behind one interface, one per ops set (layers/ops.py): `TorchAttentionBackend` (plain torch:
gathered slots and scaled_dot_product_attention), `CpuAttentionBackend` (radixgen.kernels.cpu's C kernels,
reading the pool in place) and `TritonAttentionBackend` (radixgen.kernels' Triton kernels). Each has a
`prepare(ctx)` that derives per-step metadata once, not once per layer; the Triton backend also has
`prepare_static(ctx, seq_lens)`, the decode metadata of a CUDA graph (cuda_graph_runner.py), taken from a
device tensor instead of host lists.

An 8-bit pool (kv_cache_dtype int8 / fp8_e4m3) is written quantized by every backend's store and read
dequantized by its attention (the kernels in registers; the torch backend, the reference, dequantizes the rows
it gathers to the model dtype). A step's new tokens attend to their own K/V as the pool holds them, quantized,
so a chunked or cached prefix gives what computing it in one step gives.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from radixgen.kernels import cpu as cpu_kernels
from radixgen.kernels.kv_quant import gather_rows, store_rows_ref
from radixgen.runtime.ground.forward_context import ForwardContext, get_forward_context
from radixgen.runtime.ground.kv_pool import KVLayer
from radixgen.runtime.layers.masked_attention import AttentionVariant, masked_attention


class DecodeMeta(NamedTuple):
    flat_slots: torch.Tensor | None  # (B * Lmax,) slots of each request's positions; padding past seq_len
    lmax: int
    mask: torch.Tensor | None  # (B, 1, 1, Lmax) True where a position is attended
    seq_lens: torch.Tensor  # (B,) int64
    req_indices: torch.Tensor  # (B,) int64, contiguous
    # the batch size the C kernel's context split is computed from, where it is not B: a verification's requests
    split_batch: int | None = None


class ExtendMeta(NamedTuple):  # the C extend kernel's step metadata
    req_indices: torch.Tensor  # (B,) int64, contiguous
    prefix_lens: list[int]
    extend_lens: list[int]


class ExtendSpan(NamedTuple):
    q_start: int
    q_end: int
    prefix_slots: torch.Tensor | None  # (P,) slots of positions [0, prefix_len), None when P == 0
    mask: torch.Tensor | None  # (E, P + E) additive float mask, 0 where attended, -inf elsewhere; None: causal


class TorchAttentionBackend:
    """Plain torch: decode gathers each request's slots and runs scaled_dot_product_attention with the query heads
    of a KV head as its rows; extend runs it per request over the gathered prefix plus the new tokens."""

    @staticmethod
    def pool_kv(k, v, kv: KVLayer, ctx: ForwardContext) -> tuple[torch.Tensor, torch.Tensor]:
        """The new tokens' K/V as extend attends to them: as computed, or for an 8-bit pool as it holds them."""
        if kv.k_scales is None:
            return k, v
        return (gather_rows(kv.k, kv.k_scales, ctx.out_slots, k.dtype).view(k.shape),
                gather_rows(kv.v, kv.v_scales, ctx.out_slots, v.dtype).view(v.shape))

    def prepare(self, ctx: ForwardContext) -> None:
        ctx.keep_rows = None  # every row is computed (see CpuAttentionBackend.prepare)
        if ctx.is_decode:
            lens = ctx.seq_lens  # a list built on each access
            lmax = max(lens)
            seq_lens = torch.tensor(lens, dtype=torch.int64)
            req_indices = ctx.req_indices.to(torch.int64).contiguous()
            slot_matrix = ctx.req_to_slot[ctx.req_indices, :lmax]
            mask = (torch.arange(lmax).unsqueeze(0) < seq_lens.unsqueeze(1))[:, None, None, :]
            ctx.attn_meta = DecodeMeta(slot_matrix.reshape(-1), lmax, mask, seq_lens, req_indices)
            return
        spans, start = [], 0
        for row, p, e in zip(ctx.req_indices.tolist(), ctx.prefix_lens, ctx.extend_lens, strict=True):
            if p == 0:
                spans.append(ExtendSpan(start, start + e, None, None))
            else:
                # new token i sits at position p + i and sees positions [0, p + i]
                cols = torch.arange(p + e).unsqueeze(0)
                rows = torch.arange(e).unsqueeze(1) + p
                # an additive mask in the model dtype, built once per step: SDPA would otherwise turn a
                # boolean mask into one in every layer
                mask = torch.zeros((e, p + e), dtype=ctx.kv_pool.dtype)
                mask.masked_fill_(cols > rows, float("-inf"))
                spans.append(ExtendSpan(start, start + e, ctx.req_to_slot[row, :p], mask))
            start += e
        ctx.attn_meta = spans

    def store(self, k, v, kv: KVLayer, ctx: ForwardContext) -> None:
        store_rows_ref(kv.k, kv.k_scales, ctx.out_slots, k)
        store_rows_ref(kv.v, kv.v_scales, ctx.out_slots, v)

    def forward(self, q, k, v, layer_id: int, scale: float, ctx: ForwardContext) -> torch.Tensor:
        """q (T, H, D), k/v (T, Hkv, D) of the new tokens -> (T, H, D)."""
        kv = ctx.kv_pool.layer(layer_id)
        self.store(k, v, kv, ctx)
        if ctx.is_decode:
            return self.decode(q, kv, ctx.attn_meta, scale)
        return self.extend(q, *self.pool_kv(k, v, kv, ctx), kv, ctx.attn_meta, scale)

    @staticmethod
    def decode(q, kv: KVLayer, meta: DecodeMeta, scale: float) -> torch.Tensor:
        b, h, d = q.shape
        hkv = kv.k.shape[1]
        # index_select on dim 0 copies whole rows: several times faster than advanced indexing
        # (B * Lmax, Hkv, D) -> (B, Hkv, Lmax, D)
        kk = gather_rows(kv.k, kv.k_scales, meta.flat_slots, q.dtype).view(b, meta.lmax, hkv, d).transpose(1, 2)
        vv = gather_rows(kv.v, kv.v_scales, meta.flat_slots, q.dtype).view(b, meta.lmax, hkv, d).transpose(1, 2)
        kk, vv = kk.contiguous(), vv.contiguous()
        # the query heads sharing a KV head act as that head's query rows: one (G x Lmax) attention
        # per (request, KV head) instead of H single-row ones (the CPU kernel is slow at one row)
        out = F.scaled_dot_product_attention(q.reshape(b, hkv, h // hkv, d), kk, vv, attn_mask=meta.mask,
                                             scale=scale)
        return out.reshape(b, h, d)

    @staticmethod
    def extend(q, k, v, kv: KVLayer, spans: list[ExtendSpan], scale: float) -> torch.Tensor:
        out = torch.empty_like(q)
        for span in spans:
            qs = q[span.q_start:span.q_end].transpose(0, 1).unsqueeze(0)  # (1, H, E, D)
            ks, vs = k[span.q_start:span.q_end], v[span.q_start:span.q_end]
            if span.prefix_slots is not None:
                ks = torch.cat([gather_rows(kv.k, kv.k_scales, span.prefix_slots, q.dtype), ks])
                vs = torch.cat([gather_rows(kv.v, kv.v_scales, span.prefix_slots, q.dtype), vs])
            ks, vs = ks.transpose(0, 1).unsqueeze(0), vs.transpose(0, 1).unsqueeze(0)  # (1, Hkv, L, D)
            o = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=span.mask, is_causal=span.mask is None,
                                               scale=scale, enable_gqa=True)
            out[span.q_start:span.q_end] = o.squeeze(0).transpose(0, 1)
        return out


def _heads_contiguous(t: torch.Tensor) -> bool:
    return t.stride(2) == 1 and t.stride(1) == t.shape[2]


class CpuAttentionBackend(TorchAttentionBackend):
    """The CPU path on radixgen.kernels.cpu's build `kl`: KV stores and decode attention are single C calls that
    read the pool through the slot table in place, and so is bf16 extend attention where the CPU has
    AVX512-BF16 (a flash-style kernel, about 2x scaled_dot_product_attention's speed); other extends, and pools
    the kernels do not take (dtype, head_dim), use the torch backend's code."""

    def __init__(self, kl: cpu_kernels.CKernels, piece: int = 0) -> None:
        self.kl = kl
        self.pool_ok: bool | None = None  # whether the kernels take the pool, decided at the first step
        # > 0 (the deterministic mode): every query, prefill rows too, is a decode query over fixed pieces of its
        # context (cpu_kernels.FIXED_PIECE), so its sums run in one order whatever the batch, the chunk or the
        # cached prefix; 0: the decode split follows the batch and extends run the extend kernel
        self.piece = piece

    def prepare(self, ctx: ForwardContext) -> None:
        k0, dtype = ctx.kv_pool.k_buffers[0], ctx.kv_pool.dtype
        if self.pool_ok is None:
            self.pool_ok = k0.is_cpu and dtype in cpu_kernels.DTYPES and k0.shape[2] <= self.kl.d_max
        if not self.pool_ok:
            return super().prepare(ctx)
        ctx.out_slots = ctx.out_slots.to(torch.int64).contiguous()
        if ctx.is_decode:
            ctx.keep_rows = None  # decode computes every row (see below)
            lens = ctx.seq_lens
            ctx.attn_meta = DecodeMeta(None, max(lens), None, torch.tensor(lens, dtype=torch.int64),
                                       ctx.req_indices.to(torch.int64).contiguous())
            return
        if ctx.verify or self.piece:
            # every row of a verification is a decode query at its own position, its context split as in a decode
            # step of the same requests (as the fused step does it): a row's attention then rounds as it would in
            # the decode step that would otherwise have computed it, and speculation leaves outputs bit for bit.
            # With fixed pieces every extend goes this way too, and its rows round as decode steps would.
            ctx.keep_rows = None
            lens = [p + i + 1 for p, e in zip(ctx.prefix_lens, ctx.extend_lens, strict=True) for i in range(e)]
            rows = ctx.req_indices.to(torch.int64).repeat_interleave(torch.tensor(ctx.extend_lens),
                                                                     output_size=len(lens))
            ctx.attn_meta = DecodeMeta(None, max(lens), None, torch.tensor(lens, dtype=torch.int64),
                                       rows.contiguous(), split_batch=len(ctx.extend_lens))
            return
        if cpu_kernels.extend_attention_supported(self.kl, dtype, k0.shape[2]):
            ctx.attn_meta = ExtendMeta(ctx.req_indices.to(torch.int64).contiguous(), list(ctx.prefix_lens),
                                       list(ctx.extend_lens))
            # Only this kernel computes a subset of the rows (ctx.keep_rows): each token is one vector lane
            # there and lanes never mix, so a row comes out bit for bit as among all the others. The other
            # paths would round differently, and a prompt's logprobs would depend on what else was asked of it.
            if ctx.keep_rows is not None and ctx.keep_rows.numel():
                req_rows, prefixes, lengths = ctx.kept_row_segments()
                ctx.rows_meta = ExtendMeta(torch.tensor(req_rows, dtype=torch.int64), prefixes, lengths)
            return
        super().prepare(ctx)

    def store(self, k, v, kv: KVLayer, ctx: ForwardContext) -> None:
        if self.pool_ok and _heads_contiguous(k) and _heads_contiguous(v):
            cpu_kernels._store_kv(self.kl, kv.k, kv.v, ctx.out_slots, k, v, kv.k_scales, kv.v_scales)
        else:
            super().store(k, v, kv, ctx)

    def forward_rows(self, q_rows, k, v, layer_id: int, scale: float, ctx: ForwardContext) -> torch.Tensor:
        """Stores k/v (T, Hkv, D) of all new tokens; returns the attention of q_rows (K, H, D), the queries of
        ctx.keep_rows only, each over its request's positions up to its own -> (K, H, D)."""
        kv = ctx.kv_pool.layer(layer_id)
        self.store(k, v, kv, ctx)
        if q_rows.shape[0] == 0:
            return q_rows.new_empty(q_rows.shape)
        meta: ExtendMeta = ctx.rows_meta
        return cpu_kernels._extend_attention(self.kl, q_rows, kv.k, kv.v, ctx.req_to_slot, meta.req_indices,
                                             meta.prefix_lens, meta.extend_lens, scale, kv.k_scales, kv.v_scales)

    def forward(self, q, k, v, layer_id: int, scale: float, ctx: ForwardContext) -> torch.Tensor:
        """q (T, H, D), k/v (T, Hkv, D) of the new tokens -> (T, H, D)."""
        if not self.pool_ok:
            return super().forward(q, k, v, layer_id, scale, ctx)
        kv = ctx.kv_pool.layer(layer_id)
        self.store(k, v, kv, ctx)
        meta = ctx.attn_meta
        if not isinstance(meta, (DecodeMeta, ExtendMeta)):  # an extend the C kernel does not take
            return self.extend(q, *self.pool_kv(k, v, kv, ctx), kv, meta, scale)
        if not _heads_contiguous(q):
            q = q.contiguous()
        if isinstance(meta, DecodeMeta):  # a decode step, or a verification's rows as decode queries
            return cpu_kernels._decode_attention(self.kl, q, kv.k, kv.v, ctx.req_to_slot, meta.req_indices,
                                                 meta.seq_lens, scale, meta.lmax, kv.k_scales, kv.v_scales,
                                                 requests=meta.split_batch, piece=self.piece)
        return cpu_kernels._extend_attention(self.kl, q, kv.k, kv.v, ctx.req_to_slot, meta.req_indices,
                                             meta.prefix_lens, meta.extend_lens, scale, kv.k_scales, kv.v_scales)


class TritonAttentionBackend:
    """The GPU path: radixgen.kernels' store_kv, decode and extend attention through the slot table. piece > 0 (the
    deterministic mode): their batch-invariant variants, every context summed over fixed pieces of that many
    positions, every new token of a prefill as a decode query at its position (radixgen.kernels.batch_invariant)."""

    def __init__(self, piece: int = 0) -> None:
        self.piece = piece
        self.splits: int | None = None  # the pieces of the step's longest context (None: of the table's width)

    def prepare(self, ctx: ForwardContext) -> None:
        dev = ctx.out_slots.device
        if self.piece:
            self.splits = max(1, -(-max(ctx.seq_lens, default=1) // self.piece))
        ctx.attn_meta = (
            torch.tensor(ctx.prefix_lens, dtype=torch.int64, device=dev),
            torch.tensor(ctx.extend_lens, dtype=torch.int64, device=dev),
            torch.tensor(ctx.seq_lens, dtype=torch.int64, device=dev),
        )
        ctx.keep_rows = None  # every row, as the other steps compute them (see CpuAttentionBackend.prepare)

    def prepare_static(self, ctx: ForwardContext, seq_lens: torch.Tensor) -> None:
        """Decode metadata for a CUDA graph: `seq_lens` (B,) is a device tensor that stays where it is between
        replays (the graph runner's static buffer), so no host list is read and nothing is allocated here.
        ctx's prefix_lens / extend_lens lists are not used (inside a graph they describe the capture batch)."""
        if not ctx.is_decode:
            raise ValueError("prepare_static is for decode steps only")
        ctx.attn_meta = (None, None, seq_lens)
        self.splits = None  # a graph replays at any length: the pieces of the whole table

    def forward(self, q, k, v, layer_id: int, scale: float, ctx: ForwardContext) -> torch.Tensor:
        from radixgen import kernels

        kv = ctx.kv_pool.layer(layer_id)
        kernels.store_kv(kv.k, kv.v, ctx.out_slots, k, v, **kv.scales())
        prefix_lens, extend_lens, seq_lens = ctx.attn_meta
        if self.piece:
            from radixgen.kernels import batch_invariant as bi

            if ctx.is_decode:
                return bi.decode_attention_fixed(q, kv.k, kv.v, ctx.req_to_slot, ctx.req_indices, seq_lens, scale,
                                                 self.piece, self.splits, **kv.scales())
            return bi.extend_attention_fixed(q, kv.k, kv.v, ctx.req_to_slot, ctx.req_indices, prefix_lens,
                                             extend_lens, scale, self.piece, self.splits, **kv.scales())
        if ctx.is_decode:
            return kernels.decode_attention(q, kv.k, kv.v, ctx.req_to_slot, ctx.req_indices, seq_lens, scale,
                                            **kv.scales())
        return kernels.extend_attention(q, kv.k, kv.v, ctx.req_to_slot, ctx.req_indices, prefix_lens,
                                        extend_lens, scale, **kv.scales())


class Attention(nn.Module):
    """GQA attention of one layer over the pool; the model calls it with this step's q, k, v. A `variant` (a
    sliding window, logit soft-capping, attention sinks: layers/masked_attention.py) runs on the masked torch
    path whatever the ops set; `scale` defaults to head_dim ** -0.5."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, layer_id: int, scale: float | None = None,
                 variant: AttentionVariant | None = None) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.layer_id = layer_id
        self.scale = head_dim ** -0.5 if scale is None else scale
        self.variant = variant if variant is not None and variant.describe() is not None else None

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        ctx = get_forward_context()
        if self.variant is not None:
            return masked_attention(q, k, v, self.layer_id, self.scale, self.variant, ctx)
        return ctx.backend.forward(q, k, v, self.layer_id, self.scale, ctx)

    def forward_rows(self, q_rows: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """K/V of every new token stored; attention for the queries of the context's keep_rows only."""
        ctx = get_forward_context()
        return ctx.backend.forward_rows(q_rows, k, v, self.layer_id, self.scale, ctx)
