"""Fused residual add + RMSNorm: residual_out = x + residual; out = residual_out / rms(residual_out) * weight.

Everything is computed in fp32 and rounded once to x's dtype. The norm is taken of residual_out as stored
(rounded to x's dtype), so a fused and an unfused layer stack see the same residual stream.
Strategy: one program per row; a first sweep over the row in BLOCK chunks writes residual_out and sums the
squares; a second sweep reloads the inputs (L2-resident by then) rather than its own writes and stores out.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from ._checks import FLOAT_DTYPES, check_same_device, check_tensor, expect, require_triton


class AddNormResult(NamedTuple):
    out: torch.Tensor  # (T, hidden) rmsnorm(residual) * weight
    residual: torch.Tensor  # (T, hidden) x + residual, or x itself when no residual was given


def _check_norm(x, weight, eps, residual) -> float:
    check_tensor("x", x, 2, FLOAT_DTYPES)
    check_tensor("weight", weight, 1, FLOAT_DTYPES)
    expect(weight.shape[0] == x.shape[1], f"weight has {weight.shape[0]} entries but x is {tuple(x.shape)}")
    if residual is not None:
        check_tensor("residual", residual, 2, FLOAT_DTYPES)
        expect(residual.shape == x.shape, f"residual {tuple(residual.shape)} must match x {tuple(x.shape)}")
        expect(residual.dtype == x.dtype, f"residual dtype {residual.dtype} must equal x dtype {x.dtype}")
    expect(x.stride(1) == 1 and weight.stride(0) == 1 and (residual is None or residual.stride(1) == 1),
           "x, residual and weight need unit stride along hidden")
    expect(isinstance(eps, (int, float)) and not isinstance(eps, bool) and eps >= 0,
           f"eps must be a float >= 0, got {eps!r}")
    check_same_device(x=x, weight=weight, residual=residual)
    return float(eps)


def fused_add_rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float,
                      residual: torch.Tensor | None = None) -> AddNormResult:
    """x, residual (T, hidden) with unit stride along hidden; weight (hidden,). Returns new tensors
    (out, residual_out); with residual=None, residual_out is x itself."""
    eps = _check_norm(x, weight, eps, residual)
    require_triton("fused_add_rmsnorm", "fused_add_rmsnorm_ref")
    from ._norm_triton import launch_fused_add_rmsnorm

    return AddNormResult(*launch_fused_add_rmsnorm(x, weight, eps, residual))


def fused_add_rmsnorm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float,
                          residual: torch.Tensor | None = None) -> AddNormResult:
    eps = _check_norm(x, weight, eps, residual)
    residual_out = x if residual is None else (x.float() + residual.float()).to(x.dtype)
    h = residual_out.float()
    out = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps) * weight.float()
    return AddNormResult(out.to(x.dtype), residual_out)
