"""Triton bodies of lora_shrink and lora_expand_ (see lora.py for the contract and strategy)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._attention_triton import _dot, _dot_precision
from ._triton_env import INTERPRET, check_launchable, next_pow2

BLOCK_M = 16  # rows of a segment per program (decode segments are short)


@triton.jit
def _segment_rows(Rows, SegStart, SegLen, SegSlot, BLOCK_M: tl.constexpr):
    """This program's rows (gathered indices), their mask and the segment's slot."""
    seg = tl.program_id(0)
    start = tl.load(SegStart + seg)
    length = tl.load(SegLen + seg)
    slot = tl.load(SegSlot + seg).to(tl.int64)
    offs_m = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    mask_m = offs_m < length  # programs past a short segment's end store nothing
    rows = tl.load(Rows + start + offs_m, mask=mask_m, other=0).to(tl.int64)
    return rows, mask_m, slot


@triton.jit
def _shrink_kernel(
    X, A, H, Rows, SegStart, SegLen, SegSlot,
    K, NR, stride_x, stride_as, stride_ablk, stride_h,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    DOT_PRECISION: tl.constexpr, WIDEN_DOT: tl.constexpr,
):
    rows, mask_m, slot = _segment_rows(Rows, SegStart, SegLen, SegSlot, BLOCK_M)
    offs_n = tl.program_id(2) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < NR
    acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        mask_k = offs_k < K
        x = tl.load(X + rows[:, None] * stride_x + offs_k[None, :], mask=mask_m[:, None] & mask_k[None, :], other=0.0)
        # a (S, NB, K/2, 16, 2): rank n, column k at [n // 16, k // 2, n % 16, k % 2]
        a = tl.load(A + slot * stride_as + (offs_n[:, None] // 16) * stride_ablk + (offs_k[None, :] // 2) * 32
                    + (offs_n[:, None] % 16) * 2 + offs_k[None, :] % 2, mask=mask_n[:, None] & mask_k[None, :],
                    other=0.0)
        acc += _dot(x, tl.trans(a), DOT_PRECISION, WIDEN_DOT)  # (BLOCK_M, BLOCK_N)
    tl.store(H + rows[:, None] * stride_h + offs_n[None, :], acc.to(H.dtype.element_ty),
             mask=mask_m[:, None] & mask_n[None, :])


@triton.jit
def _expand_kernel(
    Y, H, B, Scales, Rows, SegStart, SegLen, SegSlot,
    R, col0, ncols, rank_offset, stride_y, stride_h, stride_bs, stride_bblk,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr,
    DOT_PRECISION: tl.constexpr, WIDEN_DOT: tl.constexpr,
):
    rows, mask_m, slot = _segment_rows(Rows, SegStart, SegLen, SegSlot, BLOCK_M)
    offs_n = tl.program_id(2) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < ncols
    offs_r = tl.arange(0, BLOCK_R)
    mask_r = offs_r < R
    h = tl.load(H + rows[:, None] * stride_h + rank_offset + offs_r[None, :],
                mask=mask_m[:, None] & mask_r[None, :], other=0.0)
    # b (S, NB, R/2, 16, 2): rank k of column n at [n // 16, k // 2, n % 16, k % 2]
    cols = col0 + offs_n[None, :]
    b = tl.load(B + slot * stride_bs + (cols // 16) * stride_bblk + (offs_r[:, None] // 2) * 32 + (cols % 16) * 2
                + offs_r[:, None] % 2, mask=mask_r[:, None] & mask_n[None, :], other=0.0)
    dtype = Y.dtype.element_ty
    d = _dot(h, b, DOT_PRECISION, WIDEN_DOT).to(dtype).to(tl.float32)  # (BLOCK_M, BLOCK_N), rounded as torch's
    d = (d * tl.load(Scales + slot)).to(dtype).to(tl.float32)
    ptrs = Y + rows[:, None] * stride_y + col0 + offs_n[None, :]
    mask = mask_m[:, None] & mask_n[None, :]
    tl.store(ptrs, (tl.load(ptrs, mask=mask, other=0.0).to(tl.float32) + d).to(dtype), mask=mask)


def launch_shrink(x, a, rows, seg_starts, seg_lens, seg_slots, max_len):
    check_launchable(x.device, "lora_shrink", "lora_shrink_ref")
    t, k = x.shape
    nr = 16 * a.shape[1]
    h = torch.zeros((t, nr), dtype=x.dtype, device=x.device)
    if seg_starts.numel() == 0 or max_len == 0:
        return h
    block_n = max(16, min(next_pow2(nr), 64))  # tl.dot needs every dimension >= 16
    block_k = max(16, min(next_pow2(k), 128))
    grid = (seg_starts.numel(), triton.cdiv(max_len, BLOCK_M), triton.cdiv(nr, block_n))
    _shrink_kernel[grid](
        x, a, h, rows, seg_starts, seg_lens, seg_slots,
        k, nr, x.stride(0), a.stride(0), a.stride(1), h.stride(0),
        BLOCK_M=BLOCK_M, BLOCK_N=block_n, BLOCK_K=block_k, DOT_PRECISION=_dot_precision(x.dtype), WIDEN_DOT=INTERPRET,
    )
    return h


def launch_expand(y, h, b, scales, rows, seg_starts, seg_lens, seg_slots, max_len, col0, col1, rank_offset):
    check_launchable(y.device, "lora_expand_", "lora_expand_ref_")
    ncols, r = col1 - col0, 2 * b.shape[2]
    if seg_starts.numel() == 0 or max_len == 0 or ncols == 0:
        return
    block_n = max(16, min(next_pow2(ncols), 128))
    grid = (seg_starts.numel(), triton.cdiv(max_len, BLOCK_M), triton.cdiv(ncols, block_n))
    _expand_kernel[grid](
        y, h, b, scales, rows, seg_starts, seg_lens, seg_slots,
        r, col0, ncols, rank_offset, y.stride(0), h.stride(0), b.stride(0), b.stride(1),
        BLOCK_M=BLOCK_M, BLOCK_N=block_n, BLOCK_R=max(16, next_pow2(r)),
        DOT_PRECISION=_dot_precision(y.dtype), WIDEN_DOT=INTERPRET,
    )
