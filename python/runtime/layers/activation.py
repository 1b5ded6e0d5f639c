from __future__ import annotations

import torch
import torch.nn.functional as F

from radixgen.kernels import cpu as cpu_kernels


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """(..., 2N) gate|up -> (..., N) silu(gate) * up."""
    ck = cpu_kernels.for_tensor(x)
    if ck is not None and x.dim() == 2 and x.is_contiguous():
        return cpu_kernels._silu_and_mul(ck, x)
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up
