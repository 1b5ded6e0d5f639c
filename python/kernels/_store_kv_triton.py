"""Triton body of store_kv (see store_kv.py for the contract)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._kv_quant_triton import format_of, pool_views, quantize_rows
from ._triton_env import check_launchable, next_pow2


@triton.jit
def _store_kv_kernel(
    K, V, KBuf, VBuf, Slots,
    stride_kt, stride_kh, stride_kd,
    stride_vt, stride_vh, stride_vd,
    stride_bs, stride_bh,  # the pools are contiguous: the last stride is 1
    HEAD_DIM: tl.constexpr, ROW: tl.constexpr, BLOCK: tl.constexpr,
):
    t = tl.program_id(0)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)  # flat index into one (Hkv, D) row
    mask = offs < ROW
    h = offs // HEAD_DIM
    d = offs % HEAD_DIM
    slot = tl.load(Slots + t).to(tl.int64)  # int64: slot * row size can pass 2**31
    dst = slot * stride_bs + h * stride_bh + d
    k = tl.load(K + t * stride_kt + h * stride_kh + d * stride_kd, mask=mask)
    tl.store(KBuf + dst, k, mask=mask)
    v = tl.load(V + t * stride_vt + h * stride_vh + d * stride_vd, mask=mask)
    tl.store(VBuf + dst, v, mask=mask)


@triton.jit
def _store_kv_quant_kernel(
    K, V, KBuf, VBuf, KScale, VScale, Slots,
    stride_kt, stride_kh, stride_kd,
    stride_vt, stride_vh, stride_vd,
    stride_bs, stride_bh, stride_ss,  # the pools and scales are contiguous: their last stride is 1
    NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
    FORMAT: tl.constexpr,
):
    t = tl.program_id(0)
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    mask_h = offs_h < NUM_HEADS
    mask = mask_h[:, None] & (offs_d < HEAD_DIM)[None, :]  # (BLOCK_H, BLOCK_D): the token's row, head by head
    slot = tl.load(Slots + t).to(tl.int64)
    dst = slot * stride_bs + offs_h[:, None] * stride_bh + offs_d[None, :]
    k = tl.load(K + t * stride_kt + offs_h[:, None] * stride_kh + offs_d[None, :] * stride_kd, mask=mask, other=0.0)
    codes, scale = quantize_rows(k.to(tl.float32), FORMAT)
    tl.store(KBuf + dst, codes, mask=mask)
    tl.store(KScale + slot * stride_ss + offs_h, scale.to(KScale.dtype.element_ty), mask=mask_h)
    v = tl.load(V + t * stride_vt + offs_h[:, None] * stride_vh + offs_d[None, :] * stride_vd, mask=mask, other=0.0)
    codes, scale = quantize_rows(v.to(tl.float32), FORMAT)
    tl.store(VBuf + dst, codes, mask=mask)
    tl.store(VScale + slot * stride_ss + offs_h, scale.to(VScale.dtype.element_ty), mask=mask_h)


def launch_store_kv(k_buffer: torch.Tensor, v_buffer: torch.Tensor, slots: torch.Tensor,
                    k: torch.Tensor, v: torch.Tensor, k_scales: torch.Tensor | None = None,
                    v_scales: torch.Tensor | None = None) -> None:
    check_launchable(k.device, "store_kv", "store_kv_ref")
    num_tokens, num_heads, head_dim = k.shape
    if num_tokens == 0:
        return
    if k_scales is not None:
        fmt = format_of(k_buffer, True)
        k_buffer, v_buffer, k_scales, v_scales, stride_ss = pool_views(k_buffer, v_buffer, k_scales, v_scales)
        _store_kv_quant_kernel[(num_tokens,)](
            k, v, k_buffer, v_buffer, k_scales, v_scales, slots,
            *k.stride(), *v.stride(),
            k_buffer.stride(0), k_buffer.stride(1), stride_ss,
            NUM_HEADS=num_heads, HEAD_DIM=head_dim, BLOCK_H=next_pow2(num_heads), BLOCK_D=next_pow2(head_dim),
            FORMAT=fmt,
        )
        return
    row = num_heads * head_dim
    block = min(next_pow2(row), 1024)
    grid = (num_tokens, triton.cdiv(row, block))
    _store_kv_kernel[grid](
        k, v, k_buffer, v_buffer, slots,
        *k.stride(), *v.stride(),
        k_buffer.stride(0), k_buffer.stride(1),
        HEAD_DIM=head_dim, ROW=row, BLOCK=block,
    )
