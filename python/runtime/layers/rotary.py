"""Rotary position embedding (rotate-half layout), with the frequency scalings of rope_scaling: llama3 (Llama 3.1 /
3.2), linear (Gemma 3's global layers) and yarn (gpt-oss; its cos / sin scaled by the attention factor)."""

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


def _yarn(inv_freq: torch.Tensor, head_dim: int, base: float, scaling: dict) -> tuple[torch.Tensor, float]:
    """YaRN: frequencies above the band [low, high] kept (extrapolated), those below divided by `factor`
    (interpolated), a linear ramp between; and the factor cos / sin are multiplied by."""
    factor, old_ctx = scaling["factor"], scaling["original_max_position_embeddings"]
    attention = scaling.get("attention_factor")
    if attention is None:
        def m(scale):  # the magnitude correction of a context `scale` times longer
            return 1.0 if factor <= 1 else 0.1 * scale * math.log(factor) + 1.0
        mscale, all_dim = scaling.get("mscale"), scaling.get("mscale_all_dim")
        attention = m(mscale) / m(all_dim) if mscale and all_dim else m(1.0)

    def dim_of(rotations: float) -> float:  # the dimension whose wavelength fits `rotations` turns in old_ctx
        return head_dim * math.log(old_ctx / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = dim_of(scaling.get("beta_fast") or 32), dim_of(scaling.get("beta_slow") or 1)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(head_dim // 2, dtype=torch.float64) - low) / (high - low)).clamp(0, 1)
    keep = 1 - ramp  # 1: extrapolated (kept), 0: interpolated
    return inv_freq / factor * (1 - keep) + inv_freq * keep, float(attention)


class RotaryEmbedding(OpsLayer):
    def __init__(self, head_dim: int, max_positions: int, base: float, scaling: dict | None = None) -> None:
        super().__init__()
        self.head_dim = head_dim
        inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
        magnitude = 1.0
        kind = None if scaling is None else scaling.get("rope_type", scaling.get("type", "llama3"))
        if kind == "llama3":
            inv_freq = _llama3_inv_freq(inv_freq, scaling)
        elif kind == "linear":  # positions divided by `factor`
            inv_freq = inv_freq / scaling["factor"]
        elif kind == "yarn":
            inv_freq, magnitude = _yarn(inv_freq, head_dim, base, scaling)
        elif kind is not None:
            raise ValueError(f"unsupported rope_scaling type {kind!r}")
        t = torch.arange(max_positions, dtype=torch.float64)
        freqs = torch.outer(t, inv_freq)  # (P, D/2)
        # (P, D): cos in the first half, sin in the second
        self.register_buffer("cos_sin_cache", torch.cat([freqs.cos(), freqs.sin()], -1).mul(magnitude).float(),
                             persistent=False)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
        """q (T, Hq, D), k (T, Hk, D) -> rotated q, k (in place where the ops set's kernel does it)."""
        return self.ops.rotary(positions, q, k, self.cos_sin_cache)

    def structure(self) -> RotaryStructure:
        """What the fused paths read: rotate-half over this one table."""
        return RotaryStructure(ROPE, self.cos_sin_cache)


class MRotaryEmbedding(RotaryEmbedding):
    """Multimodal rotary (Qwen2-VL's M-RoPE): each of a token's three position ids (temporal, height, width)
    drives its own section of the rotary frequencies, `sections` (summing to head_dim / 2) in that order.

    Positions are (3, T), or (T,) for tokens whose three ids are equal (all text, and every token after the
    prompt's last image): those rotate exactly as the plain rotary over the same table, which is why
    `structure()` says ROPE and the fused decode step runs such a model unchanged."""

    def __init__(self, head_dim: int, max_positions: int, base: float, sections: tuple[int, ...]) -> None:
        super().__init__(head_dim, max_positions, base)
        if len(sections) != 3 or sum(sections) != head_dim // 2:
            raise ValueError(f"mrope_section {list(sections)}: 3 sizes summing to head_dim / 2 = {head_dim // 2}")
        self.sections = tuple(sections)
        self._composed: tuple = (None, None, None)  # (positions, rows, per-token table): one lookup per step

    def per_token_table(self, positions: torch.Tensor) -> torch.Tensor:
        """(3, T) positions -> (T, D) table, cos | sin halves, each frequency's angle taken at its section's id."""
        half = self.head_dim // 2
        rows = self.cos_sin_cache[positions]  # (3, T, D)
        cos, sin, start = [], [], 0
        for axis, size in enumerate(self.sections):
            cos.append(rows[axis, :, start:start + size])
            sin.append(rows[axis, :, half + start:half + start + size])
            start += size
        return torch.cat(cos + sin, dim=-1)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
        if positions.dim() == 1:
            return super().forward(positions, q, k)
        last, rows, table = self._composed
        if positions is not last:  # every layer of a step passes the same positions tensor
            table = self.per_token_table(positions)
            rows = torch.arange(positions.shape[1], device=positions.device)
            self._composed = (positions, rows, table)
        return self.ops.rotary(rows, q, k, table)
