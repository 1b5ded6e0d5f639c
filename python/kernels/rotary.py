"""Rotary position embedding, neox / rotate-half style (as HF Llama), applied in place to q and k.

With half = D/2, cos = cache[pos, :half], sin = cache[pos, half:], x1 = x[..., :half], x2 = x[..., half:]:
    x <- cat(x1 * cos - x2 * sin, x2 * cos + x1 * sin)
computed in fp32 and rounded once to the tensor's dtype. The rotation covers the whole head (rotary dim = D).
Strategy: one program per (token, q-or-k); it loads the token's cos/sin row once and rotates all that
tensor's heads as one (heads, D/2) tile.
"""

from __future__ import annotations

import torch

from ._checks import FLOAT_DTYPES, INDEX_DTYPES, check_same_device, check_tensor, expect, require_triton


def _heads_view(name: str, t: torch.Tensor, head_dim: int) -> torch.Tensor:
    """(T, H, D) as given, or (T, H*D) unflattened to a (T, H, D) view."""
    check_tensor(name, t, (2, 3), FLOAT_DTYPES)
    if t.dim() == 3:
        expect(t.shape[2] == head_dim, f"{name} is {tuple(t.shape)}: last dim must be head_dim={head_dim}")
        return t
    expect(t.shape[1] % head_dim == 0, f"{name} is {tuple(t.shape)}: width not a multiple of {head_dim}")
    return t.unflatten(1, (t.shape[1] // head_dim, head_dim))


def _check_rotary(positions, q, k, cos_sin_cache, head_dim) -> tuple[torch.Tensor, torch.Tensor]:
    expect(isinstance(head_dim, int) and head_dim > 0 and head_dim % 2 == 0,
           f"head_dim must be a positive even int, got {head_dim!r}")
    check_tensor("positions", positions, 1, INDEX_DTYPES)
    check_tensor("cos_sin_cache", cos_sin_cache, 2, (torch.float32,))
    expect(cos_sin_cache.shape[1] == head_dim,
           f"cos_sin_cache is {tuple(cos_sin_cache.shape)}: width must be head_dim={head_dim} "
           "(cos then sin; partial rotary is not supported)")
    q3, k3 = _heads_view("q", q, head_dim), _heads_view("k", k, head_dim)
    expect(q3.shape[0] == positions.shape[0] and k3.shape[0] == positions.shape[0],
           f"q ({q3.shape[0]} tokens) and k ({k3.shape[0]}) must have one row per position "
           f"({positions.shape[0]})")
    check_same_device(positions=positions, q=q, k=k, cos_sin_cache=cos_sin_cache)
    return q3, k3


def rotary_embedding_(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                      cos_sin_cache: torch.Tensor, head_dim: int) -> None:
    """In place on q (T, Hq, D) or (T, Hq*D) and k (T, Hk, D) or (T, Hk*D), any strides; positions (T,) int;
    cos_sin_cache (max_pos, D) float32. Positions are not range-checked (device sync)."""
    q3, k3 = _check_rotary(positions, q, k, cos_sin_cache, head_dim)
    require_triton("rotary_embedding_", "rotary_embedding_ref_")
    from ._rotary_triton import launch_rotary

    launch_rotary(positions, q3, k3, cos_sin_cache)


def rotary_embedding_ref_(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                          cos_sin_cache: torch.Tensor, head_dim: int) -> None:
    q3, k3 = _check_rotary(positions, q, k, cos_sin_cache, head_dim)
    half = head_dim // 2
    cos_sin = cos_sin_cache[positions.long()]  # (T, D)
    cos, sin = cos_sin[:, None, :half], cos_sin[:, None, half:]  # (T, 1, D/2)
    for t in (q3, k3):
        x1, x2 = t[..., :half].float(), t[..., half:].float()
        rotated = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
        t.copy_(rotated)
