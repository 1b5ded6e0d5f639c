"""Triton bodies of decode_attention and extend_attention (see attention.py for the contract and strategy).

Scores are kept in base 2 (scaled by sm_scale * log2(e)) so the softmax uses exp2, the native instruction;
the log-sum-exp passed between the two decode stages is in base 2 as well.

An 8-bit pool (FORMAT INT8 / FP8, _kv_quant_triton.py) is dequantized in registers: the codes of a K/V block
become q's dtype exactly (int8 and e4m3 values fit in bf16 / fp16), and the per-(slot, head) scales multiply
the scores (K) and the softmax weights after their sum (V), one per key, rather than every element.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from ._kv_quant_triton import format_of, kv_values, pool_views
from ._triton_env import INTERPRET, check_launchable, next_pow2

LOG2E = 1.4426950408889634
MAX_KV_SPLITS = 32


@triton.jit
def _dot(a, b, DOT_PRECISION: tl.constexpr, WIDEN: tl.constexpr):
    if WIDEN:  # the interpreter multiplies bf16 bit patterns as integers; fp32 products of bf16 are exact
        a = a.to(tl.float32)
        b = b.to(tl.float32)
    return tl.dot(a, b, input_precision=DOT_PRECISION)


@triton.jit
def _load_kv_block(Buf, Scale, slots, kv_head, stride_s, stride_h, stride_ss, offs_d, kv_mask, mask_n,
                   dtype: tl.constexpr, FORMAT: tl.constexpr):
    """(BLOCK_N, BLOCK_D) of one KV head in `dtype`, and the (BLOCK_N,) scales of its rows (1 without)."""
    block = tl.load(Buf + slots[:, None] * stride_s + kv_head * stride_h + offs_d[None, :], mask=kv_mask, other=0)
    if FORMAT == 0:
        return block, tl.full(slots.shape, 1.0, tl.float32)
    scales = tl.load(Scale + slots * stride_ss + kv_head, mask=mask_n, other=0.0).to(tl.float32)
    return kv_values(block, FORMAT).to(dtype), scales


@triton.jit
def _split_len(seq_len, num_splits, BLOCK_N: tl.constexpr):
    # tokens per split, rounded up to whole blocks: only the last non-empty split has a partial block
    return tl.cdiv(tl.cdiv(seq_len, num_splits), BLOCK_N) * BLOCK_N


@triton.jit
def _decode_partial_kernel(
    Q, K, V, KScale, VScale, ReqToSlot, ReqIdx, SeqLens, MidO, MidLse,
    qk_scale, num_splits,  # a runtime value, not constexpr: the auto choice varies with the batch size
    stride_qb, stride_qh, stride_qd,
    stride_ks, stride_kh,
    stride_vs, stride_vh,
    stride_ss,  # KScale / VScale (slots, Hkv) contiguous
    stride_rr, stride_rc,
    stride_mb, stride_mh, stride_ms,  # MidO (B, H, S, D) contiguous
    stride_lb, stride_lh,  # MidLse (B, H, S) contiguous
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, DOT_PRECISION: tl.constexpr,
    WIDEN_DOT: tl.constexpr, FORMAT: tl.constexpr, PIECE: tl.constexpr,
):
    b = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(SeqLens + b).to(tl.int32)
    if PIECE > 0:  # the deterministic mode: cuts at fixed positions, whatever the batch
        split_len = PIECE
    else:
        split_len = _split_len(seq_len, num_splits, BLOCK_N)
    start = split * split_len
    end = tl.minimum(start + split_len, seq_len)
    if start < end:  # splits past a short request's length stay empty; stage 2 never reads them
        row = tl.load(ReqIdx + b).to(tl.int64)
        offs_g = tl.arange(0, BLOCK_H)
        offs_d = tl.arange(0, BLOCK_D)
        offs_n = tl.arange(0, BLOCK_N)
        heads = kv_head * GROUP + offs_g  # the query heads sharing this kv head
        mask_g = offs_g < GROUP
        mask_d = offs_d < HEAD_DIM
        q = tl.load(Q + b * stride_qb + heads[:, None] * stride_qh + offs_d[None, :] * stride_qd,
                    mask=mask_g[:, None] & mask_d[None, :], other=0.0)  # (BLOCK_H, BLOCK_D)

        m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_H], tl.float32)
        acc = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
        for n0 in range(start, end, BLOCK_N):
            pos = n0 + offs_n
            mask_n = pos < end
            slots = tl.load(ReqToSlot + row * stride_rr + pos * stride_rc, mask=mask_n, other=0).to(tl.int64)
            kv_mask = mask_n[:, None] & mask_d[None, :]
            k, k_scale = _load_kv_block(K, KScale, slots, kv_head, stride_ks, stride_kh, stride_ss, offs_d, kv_mask,
                                        mask_n, q.dtype, FORMAT)  # (BLOCK_N, BLOCK_D), (BLOCK_N,)
            s = _dot(q, tl.trans(k), DOT_PRECISION, WIDEN_DOT) * qk_scale  # (BLOCK_H, BLOCK_N)
            if FORMAT != 0:
                s = s * k_scale[None, :]
            s = tl.where(mask_n[None, :], s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))  # finite: every block holds >= 1 valid position
            alpha = tl.exp2(m_i - m_new)
            p = tl.exp2(s - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            v, v_scale = _load_kv_block(V, VScale, slots, kv_head, stride_vs, stride_vh, stride_ss, offs_d, kv_mask,
                                        mask_n, q.dtype, FORMAT)
            if FORMAT != 0:
                p = p * v_scale[None, :]
            acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, DOT_PRECISION, WIDEN_DOT)
            m_i = m_new

        out_mask = mask_g[:, None] & mask_d[None, :]
        tl.store(MidO + b * stride_mb + heads[:, None] * stride_mh + split * stride_ms + offs_d[None, :],
                 acc / l_i[:, None], mask=out_mask)
        tl.store(MidLse + b * stride_lb + heads * stride_lh + split, m_i + tl.log2(l_i), mask=mask_g)


@triton.jit
def _decode_merge_kernel(
    MidO, MidLse, SeqLens, Out, num_splits,
    stride_mb, stride_mh, stride_ms,
    stride_lb, stride_lh,
    stride_ob, stride_oh,  # O (B, H, D) contiguous
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, PIECE: tl.constexpr,
):
    b = tl.program_id(0)
    head = tl.program_id(1)
    seq_len = tl.load(SeqLens + b).to(tl.int32)
    if PIECE > 0:
        split_len = PIECE
    else:
        split_len = tl.maximum(_split_len(seq_len, num_splits, BLOCK_N), 1)
    num_used = tl.cdiv(seq_len, split_len)  # the non-empty splits, exactly those stage 1 wrote
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < HEAD_DIM
    m = float("-inf")
    l_sum = 0.0
    acc = tl.zeros([BLOCK_D], tl.float32)
    for split in range(0, num_used):
        lse = tl.load(MidLse + b * stride_lb + head * stride_lh + split)
        part = tl.load(MidO + b * stride_mb + head * stride_mh + split * stride_ms + offs_d,
                       mask=mask_d, other=0.0)
        m_new = tl.maximum(m, lse)
        alpha = tl.exp2(m - m_new)
        w = tl.exp2(lse - m_new)
        acc = acc * alpha + w * part
        l_sum = l_sum * alpha + w
        m = m_new
    out = (acc / l_sum).to(Out.dtype.element_ty)
    tl.store(Out + b * stride_ob + head * stride_oh + offs_d, out, mask=mask_d)


@triton.jit
def _extend_kernel(
    Q, K, V, KScale, VScale, Out, ReqToSlot, ReqIdx, PrefixLens, ExtendLens, QStarts, BlockEnds, BlockReq,
    qk_scale, num_reqs,
    stride_qt, stride_qh, stride_qd,
    stride_ks, stride_kh,
    stride_vs, stride_vh,
    stride_ss,
    stride_rr, stride_rc,
    stride_ot, stride_oh,  # O (T, H, D) contiguous
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, DOT_PRECISION: tl.constexpr,
    WIDEN_DOT: tl.constexpr, FORMAT: tl.constexpr,
):
    pid = tl.program_id(0)
    head = tl.program_id(1)
    b = tl.load(BlockReq + pid).to(tl.int32)
    if b < num_reqs:  # grid axis 0 is an upper bound on the block count; the spare programs do nothing
        extend = tl.load(ExtendLens + b).to(tl.int32)
        prefix = tl.load(PrefixLens + b).to(tl.int32)
        q_start = tl.load(QStarts + b)
        row = tl.load(ReqIdx + b).to(tl.int64)
        block = pid - (tl.load(BlockEnds + b).to(tl.int32) - tl.cdiv(extend, BLOCK_M))  # block within request
        kv_head = head // GROUP

        offs_m = block * BLOCK_M + tl.arange(0, BLOCK_M)  # index among the request's new tokens
        offs_n = tl.arange(0, BLOCK_N)
        offs_d = tl.arange(0, BLOCK_D)
        mask_m = offs_m < extend
        mask_d = offs_d < HEAD_DIM
        q_rows = q_start + offs_m
        q = tl.load(Q + q_rows[:, None] * stride_qt + head * stride_qh + offs_d[None, :] * stride_qd,
                    mask=mask_m[:, None] & mask_d[None, :], other=0.0)  # (BLOCK_M, BLOCK_D)
        q_pos = prefix + offs_m
        kv_end = prefix + tl.minimum((block + 1) * BLOCK_M, extend)  # past the last key this block needs

        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
        for n0 in range(0, kv_end, BLOCK_N):
            pos = n0 + offs_n
            mask_n = pos < kv_end
            slots = tl.load(ReqToSlot + row * stride_rr + pos * stride_rc, mask=mask_n, other=0).to(tl.int64)
            kv_mask = mask_n[:, None] & mask_d[None, :]
            k, k_scale = _load_kv_block(K, KScale, slots, kv_head, stride_ks, stride_kh, stride_ss, offs_d, kv_mask,
                                        mask_n, q.dtype, FORMAT)  # (BLOCK_N, BLOCK_D), (BLOCK_N,)
            s = _dot(q, tl.trans(k), DOT_PRECISION, WIDEN_DOT) * qk_scale  # (BLOCK_M, BLOCK_N)
            if FORMAT != 0:
                s = s * k_scale[None, :]
            # position 0 passes this mask for every row, so the first block makes m_i finite
            s = tl.where(mask_n[None, :] & (pos[None, :] <= q_pos[:, None]), s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            alpha = tl.exp2(m_i - m_new)
            p = tl.exp2(s - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            v, v_scale = _load_kv_block(V, VScale, slots, kv_head, stride_vs, stride_vh, stride_ss, offs_d, kv_mask,
                                        mask_n, q.dtype, FORMAT)
            if FORMAT != 0:
                p = p * v_scale[None, :]
            acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, DOT_PRECISION, WIDEN_DOT)
            m_i = m_new

        out = (acc / l_i[:, None]).to(Out.dtype.element_ty)
        tl.store(Out + q_rows[:, None] * stride_ot + head * stride_oh + offs_d[None, :], out,
                 mask=mask_m[:, None] & mask_d[None, :])


def _dot_precision(dtype: torch.dtype) -> str:
    # fp32 pools are for exactness (tests, debugging): no tf32 rounding. For 16-bit inputs this is ignored.
    return "ieee" if dtype == torch.float32 else "tf32"


def _auto_kv_splits(batch: int, num_kv_heads: int, max_len: int, block_n: int, device: torch.device) -> int:
    """Enough stage-1 programs for ~4 waves over the SMs, without splits shorter than one block."""
    if device.type == "cuda":
        num_sms = torch.cuda.get_device_properties(device).multi_processor_count
    else:
        num_sms = 2  # the interpreter: few programs is fastest
    splits = math.ceil(4 * num_sms / max(batch * num_kv_heads, 1))
    return max(1, min(splits, MAX_KV_SPLITS, math.ceil(max_len / block_n)))


def launch_decode(q, k_buffer, v_buffer, req_to_slot, req_indices, seq_lens, sm_scale, num_kv_splits,
                  k_scales=None, v_scales=None, piece: int = 0):
    """piece > 0 (a multiple of the block): every context cut at multiples of `piece` positions and the pieces
    merged in order, so a row's bits depend only on its own query and context (num_kv_splits: at least the
    pieces of the longest context, or None for those of req_to_slot's width)."""
    check_launchable(q.device, "decode_attention", "decode_attention_ref")
    fmt = format_of(k_buffer, k_scales is not None)
    k_buffer, v_buffer, k_scales, v_scales, stride_ss = pool_views(k_buffer, v_buffer, k_scales, v_scales)
    batch, num_q_heads, head_dim = q.shape
    num_kv_heads = k_buffer.shape[1]
    group = num_q_heads // num_kv_heads
    o = torch.empty((batch, num_q_heads, head_dim), dtype=q.dtype, device=q.device)
    if batch == 0:
        return o
    block_n = 16 if INTERPRET else 64
    block_d = max(16, next_pow2(head_dim))  # tl.dot needs every dimension >= 16
    block_h = max(16, next_pow2(group))
    if piece:
        if piece % block_n:
            raise ValueError(f"decode_attention: piece {piece} is no multiple of the kernel's {block_n}-key blocks")
        splits = num_kv_splits or triton.cdiv(req_to_slot.shape[1], piece)
    else:
        splits = num_kv_splits or _auto_kv_splits(batch, num_kv_heads, req_to_slot.shape[1], block_n, q.device)
    mid_o = torch.empty((batch, num_q_heads, splits, head_dim), dtype=torch.float32, device=q.device)
    mid_lse = torch.empty((batch, num_q_heads, splits), dtype=torch.float32, device=q.device)

    _decode_partial_kernel[(batch, num_kv_heads, splits)](
        q, k_buffer, v_buffer, k_scales, v_scales, req_to_slot, req_indices, seq_lens, mid_o, mid_lse,
        sm_scale * LOG2E, splits,
        *q.stride(),
        k_buffer.stride(0), k_buffer.stride(1),
        v_buffer.stride(0), v_buffer.stride(1),
        stride_ss,
        *req_to_slot.stride(),
        mid_o.stride(0), mid_o.stride(1), mid_o.stride(2),
        mid_lse.stride(0), mid_lse.stride(1),
        GROUP=group, HEAD_DIM=head_dim,
        BLOCK_H=block_h, BLOCK_D=block_d, BLOCK_N=block_n, DOT_PRECISION=_dot_precision(q.dtype),
        WIDEN_DOT=INTERPRET, FORMAT=fmt, PIECE=piece,
        num_warps=4, num_stages=2,
    )
    _decode_merge_kernel[(batch, num_q_heads)](
        mid_o, mid_lse, seq_lens, o, splits,
        mid_o.stride(0), mid_o.stride(1), mid_o.stride(2),
        mid_lse.stride(0), mid_lse.stride(1),
        o.stride(0), o.stride(1),
        HEAD_DIM=head_dim, BLOCK_D=block_d, BLOCK_N=block_n, PIECE=piece,
        num_warps=1 if block_d <= 64 else 2,
    )
    return o


def launch_extend(q, k_buffer, v_buffer, req_to_slot, req_indices, prefix_lens, extend_lens, sm_scale,
                  k_scales=None, v_scales=None):
    check_launchable(q.device, "extend_attention", "extend_attention_ref")
    fmt = format_of(k_buffer, k_scales is not None)
    k_buffer, v_buffer, k_scales, v_scales, stride_ss = pool_views(k_buffer, v_buffer, k_scales, v_scales)
    num_tokens, num_q_heads, head_dim = q.shape
    num_kv_heads = k_buffer.shape[1]
    batch = req_indices.shape[0]
    o = torch.empty((num_tokens, num_q_heads, head_dim), dtype=q.dtype, device=q.device)
    if num_tokens == 0 or batch == 0:
        return o
    if INTERPRET:
        block_m, block_n, num_warps = 16, 16, 4
    elif q.dtype == torch.float32 or head_dim > 128:
        block_m, block_n, num_warps = 32, 32, 4  # keeps the fp32 / wide-head tiles inside shared memory
    else:
        block_m, block_n, num_warps = 64, 64, 4
    block_d = max(16, next_pow2(head_dim))

    # Lay the requests' query blocks end to end on grid axis 0 without reading lengths back to the host:
    # sum(ceil(n_b / M)) <= T / M + B bounds the block count, and each program finds its request by search.
    extend = extend_lens.long()
    q_starts = torch.cumsum(extend, 0) - extend  # (B,) first row of each request in q
    block_ends = torch.cumsum((extend + block_m - 1) // block_m, 0)  # (B,) one past each request's last block
    grid_m = triton.cdiv(num_tokens, block_m) + batch
    block_req = torch.searchsorted(block_ends, torch.arange(grid_m, device=q.device), right=True)  # B = spare

    _extend_kernel[(grid_m, num_q_heads)](
        q, k_buffer, v_buffer, k_scales, v_scales, o, req_to_slot, req_indices, prefix_lens, extend_lens, q_starts,
        block_ends, block_req,
        sm_scale * LOG2E, batch,
        *q.stride(),
        k_buffer.stride(0), k_buffer.stride(1),
        v_buffer.stride(0), v_buffer.stride(1),
        stride_ss,
        *req_to_slot.stride(),
        o.stride(0), o.stride(1),
        GROUP=num_q_heads // num_kv_heads, HEAD_DIM=head_dim,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=block_d, DOT_PRECISION=_dot_precision(q.dtype),
        WIDEN_DOT=INTERPRET, FORMAT=fmt,
        num_warps=num_warps, num_stages=2,
    )
    return o
