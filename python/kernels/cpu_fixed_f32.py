"""The deterministic mode's float32 matmul (csrc/cpu_linear_f32_fixed.h): float32 weights laid out once as
[ceil(N / 16)][K][16], applied to float32 rows with one fused multiply-add chain per output in input order. A row's
bits depend on nothing but the row and the weight: not on the row count of the call, the threads or the build
(AVX-512, AVX2 and the scalar fallback give the same bits)."""

from __future__ import annotations

import torch

from ._checks import check_contiguous, check_tensor, expect
from ._cpu_bindings import CKernels


def pack(w: torch.Tensor) -> torch.Tensor:
    """(N, K) weight -> the (ceil(N / 16), K, 16) float32 layout, zero rows past N."""
    check_tensor("w", w, 2, (torch.float32, torch.bfloat16, torch.float16))
    n, k = w.shape
    pad = -n % 16
    w = w.float()
    if pad:
        w = torch.cat([w, w.new_zeros(pad, k)])
    return w.view(-1, 16, k).transpose(1, 2).contiguous()


def unpack(packed: torch.Tensor, n: int) -> torch.Tensor:
    """The (n, K) float32 weight back (exact)."""
    return packed.transpose(1, 2).reshape(-1, packed.shape[1])[:n]


def rows(packed: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """(len(ids), K) float32 rows `ids` of the weight (an embedding lookup of a tied LM head)."""
    return packed[ids // 16, :, ids % 16]


def linear(kl: CKernels, packed: torch.Tensor, n: int, x: torch.Tensor,
           bias: torch.Tensor | None = None) -> torch.Tensor:
    """(M, K) float32 x -> (M, n) float32 x @ w^T (+ bias (n,) float32)."""
    check_tensor("x", x, 2, (torch.float32,))
    check_contiguous("x", x)
    check_tensor("packed", packed, 3, (torch.float32,))
    k = packed.shape[1]
    expect(x.shape[1] == k and packed.shape[2] == 16 and packed.shape[0] * 16 >= n > packed.shape[0] * 16 - 16,
           f"x (M, {k}) and a packed weight of {n} rows, got x {tuple(x.shape)}, packed {tuple(packed.shape)}")
    if bias is not None:
        check_tensor("bias", bias, 1, (torch.float32,))
        expect(bias.shape[0] == n and bias.is_contiguous(), f"bias must be {n} contiguous float32 values")
    y = torch.empty((x.shape[0], n), dtype=torch.float32)
    kl.fn("rg_linear_f32_fixed")(w=packed.data_ptr(), N=n, K=k, x=x.data_ptr(), M=x.shape[0],
                                 bias=None if bias is None else bias.data_ptr(), y=y.data_ptr())
    return y
