from __future__ import annotations

import torch

from radixgen.runtime.layers.ops import OpsLayer


class SiluAndMul(OpsLayer):
    """(..., 2N) gate|up -> (..., N) silu(gate) * up."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.ops.silu_and_mul(x)
