"""Triton body of store_kv (see store_kv.py for the contract)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

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


def launch_store_kv(k_buffer: torch.Tensor, v_buffer: torch.Tensor, slots: torch.Tensor,
                    k: torch.Tensor, v: torch.Tensor) -> None:
    check_launchable(k.device, "store_kv", "store_kv_ref")
    num_tokens, num_heads, head_dim = k.shape
    if num_tokens == 0:
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
