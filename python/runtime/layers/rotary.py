"""Rotary position embedding (rotate-half layout), with Llama 3 frequency scaling."""

from __future__ import annotations

import math

import torch
from torch import nn

from radixgen.kernels import cpu as cpu_kernels


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


class RotaryEmbedding(nn.Module):
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
        self.use_triton = False  # set by ModelRunner on CUDA: radixgen.kernels.rotary_embedding_

    _last: tuple = (None, None, None)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
        """q (T, Hq, D), k (T, Hk, D) -> rotated q, k: in place by the Triton or CPU kernel, else copies."""
        if self.use_triton:
            from radixgen import kernels

            kernels.rotary_embedding_(positions, q, k, self.cos_sin_cache, self.head_dim)
            return q, k
        ck = cpu_kernels.for_tensor(q)
        if (ck is not None and positions.dtype == torch.int64 and positions.is_contiguous()
                and q.stride(2) == k.stride(2) == 1 and q.stride(1) == k.stride(1) == self.head_dim):
            cpu_kernels._rotary(ck, positions, q, k, self.cos_sin_cache)
            return q, k
        # every layer of a step passes the same positions tensor: look the table up once per step
        last_pos, last_dtype, cos_sin = self._last
        if positions is not last_pos or q.dtype != last_dtype:
            cos, sin = self.cos_sin_cache[positions].to(q.dtype).chunk(2, dim=-1)  # (T, D/2) each
            cos_sin = (cos.unsqueeze(1), sin.unsqueeze(1))
            self._last = (positions, q.dtype, cos_sin)
        cos, sin = cos_sin
        return _rotate(q, cos, sin), _rotate(k, cos, sin)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
