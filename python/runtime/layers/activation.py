from __future__ import annotations

import torch

from radixgen.kernels import cpu as cpu_kernels


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """(..., 2N) gate|up -> (..., N) silu(gate) * up; one C call for bf16 on AVX512-BF16 CPUs (same bits)."""
    if x.dtype == torch.bfloat16 and x.dim() == 2 and x.is_contiguous():
        ck = cpu_kernels.for_tensor(x)
        if ck is not None and ck.has_decode_step:
            return cpu_kernels._silu_and_mul(ck, x)
    return cpu_kernels.silu_and_mul_ref(x)
