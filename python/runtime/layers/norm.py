from __future__ import annotations

import torch
from torch import nn

from radixgen.runtime.layers.ops import OpsLayer


class RMSNorm(OpsLayer):
    """RMSNorm computed in float32; with `residual`, adds it first and returns (normed, new residual)."""

    def __init__(self, hidden: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden), requires_grad=False)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        if residual is None:
            return self.ops.rms_norm(x, self.weight, self.eps)
        return self.ops.add_rms_norm(x, residual, self.weight, self.eps)
