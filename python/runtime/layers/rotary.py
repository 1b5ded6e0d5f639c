"""Rotary position embedding (rotate-half layout), with Llama 3 frequency scaling."""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

from radixgen.runtime.layers.ops import OpsLayer

ROPE = "rope"  # RotaryStructure.kind of RotaryEmbedding


class RotaryStructure(NamedTuple):
    """A rotary as a fused kernel reads it: its kind (ROPE: positions index `cos_sin_cache` (P, D), cos | sin
    halves, rotate-half) and its table. Another rotary (M-RoPE) has another kind, which the fused paths refuse."""

    kind: str
    cos_sin_cache: torch.Tensor | None


def _llama3_inv_freq(inv_freq: torch.Tensor, scaling: dict) -> torch.Tensor:
    factor = scaling["factor"]
    low, high = scaling.get("low_freq_factor", 1.0), scaling.get("high_freq_factor", 4.0)
    old_ctx = scaling["original_max_position_embeddings"]
    low_wavelen, high_wavelen = old_ctx / low, old_ctx / high
    wavelen = 2 * math.pi / inv_freq
    # long wavelengths are slowed by `factor`, short ones kept, the band between interpolated
    smooth = (old_ctx / wavelen - low) / (high - low)
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    mid = (wavelen <= low_wavelen) & (wavelen >= high_wavelen)
    return torch.where(mid, (1 - smooth) * inv_freq / factor + smooth * inv_freq, scaled)


class RotaryEmbedding(OpsLayer):
    def __init__(self, head_dim: int, max_positions: int, base: float, scaling: dict | None = None) -> None:
        super().__init__()
        self.head_dim = head_dim
        inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
        if scaling is not None:
            inv_freq = _llama3_inv_freq(inv_freq, scaling)
        t = torch.arange(max_positions, dtype=torch.float64)
        freqs = torch.outer(t, inv_freq)  # (P, D/2)
        # (P, D): cos in the first half, sin in the second
        self.register_buffer("cos_sin_cache", torch.cat([freqs.cos(), freqs.sin()], -1).float(),
                             persistent=False)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
        """q (T, Hq, D), k (T, Hk, D) -> rotated q, k (in place where the ops set's kernel does it)."""
        return self.ops.rotary(positions, q, k, self.cos_sin_cache)

    def structure(self) -> RotaryStructure:
        """What the fused paths read: rotate-half over this one table."""
        return RotaryStructure(ROPE, self.cos_sin_cache)
