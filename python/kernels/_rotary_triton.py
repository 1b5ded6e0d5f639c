"""Triton body of rotary_embedding_ (see rotary.py for the contract and strategy)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._triton_env import check_launchable, next_pow2


@triton.jit
def _rotate_heads(X, stride_h, stride_d, num_heads, cos, sin,
                  HALF: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr):
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_HALF)
    mask = (offs_h[:, None] < num_heads) & (offs_d[None, :] < HALF)
    ptr1 = X + offs_h[:, None] * stride_h + offs_d[None, :] * stride_d  # (BLOCK_H, BLOCK_HALF) first halves
    ptr2 = ptr1 + HALF * stride_d
    x1 = tl.load(ptr1, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(ptr2, mask=mask, other=0.0).to(tl.float32)
    tl.store(ptr1, (x1 * cos[None, :] - x2 * sin[None, :]).to(X.dtype.element_ty), mask=mask)
    tl.store(ptr2, (x2 * cos[None, :] + x1 * sin[None, :]).to(X.dtype.element_ty), mask=mask)


@triton.jit
def _rotary_kernel(
    Positions, Q, K, Cache,
    num_q_heads, num_k_heads,
    stride_qt, stride_qh, stride_qd,
    stride_kt, stride_kh, stride_kd,
    stride_cp, stride_cd,
    HALF: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr,
):
    t = tl.program_id(0)
    pos = tl.load(Positions + t).to(tl.int64)
    offs_d = tl.arange(0, BLOCK_HALF)
    mask_d = offs_d < HALF
    cos = tl.load(Cache + pos * stride_cp + offs_d * stride_cd, mask=mask_d, other=0.0)
    sin = tl.load(Cache + pos * stride_cp + (HALF + offs_d) * stride_cd, mask=mask_d, other=0.0)
    if tl.program_id(1) == 0:
        _rotate_heads(Q + t.to(tl.int64) * stride_qt, stride_qh, stride_qd, num_q_heads, cos, sin,
                      HALF, BLOCK_H, BLOCK_HALF)
    else:
        _rotate_heads(K + t.to(tl.int64) * stride_kt, stride_kh, stride_kd, num_k_heads, cos, sin,
                      HALF, BLOCK_H, BLOCK_HALF)


def launch_rotary(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                  cos_sin_cache: torch.Tensor) -> None:
    """q (T, Hq, D), k (T, Hk, D) views, written in place."""
    check_launchable(q.device, "rotary_embedding_", "rotary_embedding_ref_")
    num_tokens, num_q_heads, head_dim = q.shape
    if num_tokens == 0:
        return
    half = head_dim // 2
    _rotary_kernel[(num_tokens, 2)](
        positions, q, k, cos_sin_cache,
        num_q_heads, k.shape[1],
        *q.stride(), *k.stride(),
        *cos_sin_cache.stride(),
        HALF=half, BLOCK_H=next_pow2(max(num_q_heads, k.shape[1])), BLOCK_HALF=next_pow2(half),
    )
