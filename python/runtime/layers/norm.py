from __future__ import annotations

import torch
from torch import nn

from radixgen.kernels import cpu as cpu_kernels


class RMSNorm(nn.Module):
    """RMSNorm computed in float32; with `residual`, adds it first and returns (normed, new residual)."""

    def __init__(self, hidden: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden), requires_grad=False)
        self.use_triton = False  # set by ModelRunner on CUDA: radixgen.kernels.fused_add_rmsnorm

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.weight.float() * xf).to(x.dtype) if self.weight.dtype != torch.float32 \
            else (self.weight * xf).to(x.dtype)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        if self.use_triton and x.dim() == 2:
            from radixgen import kernels

            out, res = kernels.fused_add_rmsnorm(x, self.weight, self.eps, residual)
            return out if residual is None else (out, res)
        ck = cpu_kernels.for_tensor(x)
        if ck is not None and x.dim() == 2 and x.stride(1) == 1 and self.weight.dtype == x.dtype:
            # one C call: the residual add happens in place on the (contiguous) residual
            if residual is None:
                return cpu_kernels._add_rmsnorm(ck, x, self.weight, self.eps, None)
            residual = residual.contiguous()
            return cpu_kernels._add_rmsnorm(ck, x, self.weight, self.eps, residual), residual
        if residual is None:
            return self._norm(x)
        residual = x + residual
        return self._norm(residual), residual
