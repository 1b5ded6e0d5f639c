"""Triton body of the fused mixture-of-experts forward (see fused_moe.py for the contract and the strategy)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._attention_triton import _dot
from ._triton_env import INTERPRET, check_launchable


@triton.jit
def _rounded(v, dtype: tl.constexpr, RNE_BF16: tl.constexpr):
    """float32 v rounded to dtype, as float32. RNE_BF16: to bf16 by its bits, to the nearest even (the interpreter's
    cast truncates; compiled Triton rounds to nearest even itself)."""
    if RNE_BF16:
        bits = v.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
        return bits.to(tl.float32, bitcast=True)
    return v.to(dtype).to(tl.float32)


@triton.jit
def _moe_gate_up_kernel(
    X, W, Places, BlockExpert, A,
    H, N_I, top_k,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, WIDEN_DOT: tl.constexpr, RNE_BF16: tl.constexpr,
):
    """A (blocks BM, I) = silu(x W_gate^T) * (x W_up^T) for the BM (token, j) places of block program_id(0), all of
    one expert; columns [program_id(1) BN, + BN) of I. Each matmul output and the SiLU rounded to x's dtype."""
    b = tl.program_id(0)
    e = tl.load(BlockExpert + b)
    if e < 0:  # past the last block of the last expert
        return
    rows = b * BM + tl.arange(0, BM)
    places = tl.load(Places + rows)
    valid = places >= 0
    tokens = tl.where(valid, places // top_k, 0)
    rn = tl.program_id(1) * BN + tl.arange(0, BN)
    mn = rn < N_I
    w_gate = W + e.to(tl.int64) * 2 * N_I * H + rn[None, :] * H
    w_up = w_gate + N_I * H
    acc_g = tl.zeros((BM, BN), tl.float32)
    acc_u = tl.zeros((BM, BN), tl.float32)
    for k0 in range(0, H, BK):
        rk = k0 + tl.arange(0, BK)
        mk = rk < H
        x = tl.load(X + tokens[:, None] * H + rk[None, :], mask=valid[:, None] & mk[None, :], other=0.0)
        wm = mk[:, None] & mn[None, :]  # (BK, BN) tiles of the gate and up rows, transposed
        g = tl.load(w_gate + rk[:, None], mask=wm, other=0.0)
        u = tl.load(w_up + rk[:, None], mask=wm, other=0.0)
        acc_g += _dot(x, g, "ieee", WIDEN_DOT)
        acc_u += _dot(x, u, "ieee", WIDEN_DOT)
    dtype = A.dtype.element_ty
    g = _rounded(acc_g, dtype, RNE_BF16)
    u = _rounded(acc_u, dtype, RNE_BF16)
    s = _rounded(g / (1.0 + tl.exp(-g)), dtype, RNE_BF16)
    a = _rounded(s * u, dtype, RNE_BF16)
    tl.store(A + rows[:, None] * N_I + rn[None, :], a.to(dtype), mask=valid[:, None] & mn[None, :])


@triton.jit
def _moe_down_kernel(
    A, W, Places, BlockExpert, TopkWeights, Terms,
    H, N_I,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, WIDEN_DOT: tl.constexpr, RNE_BF16: tl.constexpr,
):
    """Terms (T k, H) float32 at each place p of block program_id(0): weight[p] * (a_p W_down^T) rounded to the
    activation dtype first; columns [program_id(1) BN, + BN) of H. Places are distinct: no two programs write one
    element."""
    b = tl.program_id(0)
    e = tl.load(BlockExpert + b)
    if e < 0:
        return
    rows = b * BM + tl.arange(0, BM)
    places = tl.load(Places + rows)
    valid = places >= 0
    rn = tl.program_id(1) * BN + tl.arange(0, BN)
    mn = rn < H
    w_down = W + e.to(tl.int64) * H * N_I + rn[None, :] * N_I
    acc = tl.zeros((BM, BN), tl.float32)
    for k0 in range(0, N_I, BK):
        rk = k0 + tl.arange(0, BK)
        mk = rk < N_I
        a = tl.load(A + rows[:, None] * N_I + rk[None, :], mask=valid[:, None] & mk[None, :], other=0.0)
        w = tl.load(w_down + rk[:, None], mask=mk[:, None] & mn[None, :], other=0.0)
        acc += _dot(a, w, "ieee", WIDEN_DOT)
    weight = tl.load(TopkWeights + places, mask=valid, other=0.0)
    y = _rounded(acc, A.dtype.element_ty, RNE_BF16) * weight[:, None]
    safe = tl.where(valid, places, 0).to(tl.int64)
    tl.store(Terms + safe[:, None] * H + rn[None, :], y, mask=valid[:, None] & mn[None, :])


def block_size(m_places: int) -> int:
    """Rows (places) per block: 16 for decode-sized batches and under the interpreter, 64 otherwise."""
    return 16 if INTERPRET or m_places <= 64 else 64


def launch_fused_moe(x, gate_up, down, topk_weights, places, block_expert, bm: int) -> torch.Tensor:
    check_launchable(x.device, "fused_moe", "fused_moe_ref")
    t, h = x.shape
    k = topk_weights.shape[1]
    n_local, two_i, _ = gate_up.shape
    i = two_i // 2
    blocks = block_expert.shape[0]
    bn = 32 if INTERPRET else 64
    bk = 32 if INTERPRET else 64
    widen = INTERPRET and x.dtype != torch.float32
    rne = INTERPRET and x.dtype == torch.bfloat16
    a = torch.empty((blocks * bm, i), dtype=x.dtype, device=x.device)
    terms = torch.zeros((t * k, h), dtype=torch.float32, device=x.device)
    _moe_gate_up_kernel[(blocks, triton.cdiv(i, bn))](
        x, gate_up, places, block_expert, a, h, i, k, BM=bm, BN=bn, BK=bk, WIDEN_DOT=widen, RNE_BF16=rne,
        num_warps=4)
    _moe_down_kernel[(blocks, triton.cdiv(h, bn))](
        a, down, places, block_expert, topk_weights, terms, h, i, BM=bm, BN=bn, BK=bk, WIDEN_DOT=widen, RNE_BF16=rne,
        num_warps=4)
    return terms
