"""Triton body of the dequantizing matmuls (see quant_matmul.py for the layouts, contracts and strategy)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._attention_triton import _dot
from ._triton_env import INTERPRET, check_launchable

AWQ, GPTQ, INT8, FP8 = 0, 1, 2, 3


@triton.jit
def _fp8_e4m3(b):
    """uint8 e4m3 bits -> float32: sign, 4 exponent bits (bias 7), 3 mantissa bits; exponent 0 is subnormal."""
    b = b.to(tl.int32)
    sign, e, m = (b >> 7) & 1, (b >> 3) & 15, b & 7
    normal = ((sign << 31) | ((e + 120) << 23) | (m << 20)).to(tl.float32, bitcast=True)
    sub = m.to(tl.float32) * 0.001953125 * (1 - 2 * sign).to(tl.float32)  # m * 2^-9
    return tl.where(e == 0, sub, normal)


@triton.jit(do_not_specialize=["M", "stride_xm", "stride_ym"])
def _dequant_matmul_kernel(
    X, W, Z, S, G, Bias, Y,
    M, N, K, group, zero_offset,
    stride_xm, stride_ym,
    MODE: tl.constexpr, HAS_BIAS: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
    WIDEN_DOT: tl.constexpr,
):
    rm = tl.program_id(0) * BM + tl.arange(0, BM)
    rn = tl.program_id(1) * BN + tl.arange(0, BN)
    mm, mn = rm < M, rn < N
    acc = tl.zeros((BM, BN), tl.float32)
    for k0 in range(0, K, BK):
        rk = k0 + tl.arange(0, BK)
        mk = rk < K
        x = tl.load(X + rm[:, None] * stride_xm + rk[None, :], mask=mm[:, None] & mk[None, :], other=0.0)
        wm = mk[:, None] & mn[None, :]  # the (BK, BN) weight tile
        if MODE == 0:  # AWQ: output column n is nibble AWQ_ORDER^-1[n % 8] of packed column n // 8
            shift = ((rn % 8) // 2 + (rn % 2) * 4) * 4
            q = (tl.load(W + rk[:, None] * (N // 8) + rn[None, :] // 8, mask=wm, other=0) >> shift[None, :]) & 15
            g = rk // group
            z = (tl.load(Z + g[:, None] * (N // 8) + rn[None, :] // 8, mask=wm, other=0) >> shift[None, :]) & 15
            s = tl.load(S + g[:, None] * N + rn[None, :], mask=wm, other=0.0)
            w = ((q - z).to(tl.float32) * s.to(tl.float32)).to(x.dtype)
        elif MODE == 1:  # GPTQ: input row k is nibble k % 8 of packed row k // 8; its group is g_idx[k]
            packed = tl.load(W + (rk[:, None] // 8) * N + rn[None, :], mask=wm, other=0)
            q = (packed >> ((rk[:, None] % 8) * 4)) & 15
            g = tl.load(G + rk, mask=mk, other=0)
            zeros = tl.load(Z + g[:, None] * (N // 8) + rn[None, :] // 8, mask=wm, other=0)
            z = (zeros >> ((rn[None, :] % 8) * 4)) & 15
            s = tl.load(S + g[:, None] * N + rn[None, :], mask=wm, other=0.0)
            w = ((q - (z + zero_offset)).to(tl.float32) * s.to(tl.float32)).to(x.dtype)
        else:  # int8 / fp8 values (N, K), scaled per output column after the loop
            v = tl.load(W + rn[None, :] * K + rk[:, None], mask=wm, other=0)
            w = (_fp8_e4m3(v) if MODE == 3 else v.to(tl.float32)).to(x.dtype)  # exact in bf16 / fp16
        acc += _dot(x, w, "ieee", WIDEN_DOT)  # fp32 inputs: no tf32 rounding
    if MODE >= 2:
        acc *= tl.load(S + rn, mask=mn, other=0.0)[None, :]
    if HAS_BIAS:
        acc += tl.load(Bias + rn, mask=mn, other=0.0).to(tl.float32)[None, :]
    tl.store(Y + rm[:, None] * stride_ym + rn[None, :], acc.to(Y.dtype.element_ty), mask=mm[:, None] & mn[None, :])


def launch_dequant_matmul(mode: int, x: torch.Tensor, w, z, s, g, bias, n: int, group: int, zero_offset: int,
                          kernel: str, batch_invariant: bool = False) -> torch.Tensor:
    check_launchable(x.device, kernel, f"{kernel}_ref")
    m, k = x.shape
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0:
        return y
    # decode steps (a few rows): narrow row tiles, wide column tiles; the interpreter gets small tiles
    # (batch_invariant: one row tile whatever m, so each row's program is the same code on the same K steps)
    bm = 16 if (m <= 16 and not batch_invariant) or INTERPRET else 64
    bn = 32 if INTERPRET else 128
    bk = 32 if INTERPRET else 64
    dummy = s  # never read where its flag says so
    _dequant_matmul_kernel[(triton.cdiv(m, bm), triton.cdiv(n, bn))](
        x, w, dummy if z is None else z, s, dummy if g is None else g, dummy if bias is None else bias, y,
        m, n, k, group, zero_offset, x.stride(0), y.stride(0),
        MODE=mode, HAS_BIAS=bias is not None, BM=bm, BN=bn, BK=bk, WIDEN_DOT=INTERPRET and x.dtype == torch.bfloat16,
        num_warps=4,
    )
    return y
