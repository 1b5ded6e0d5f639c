"""Argument checks shared by the kernel wrappers; every failure is a ValueError naming the argument."""

from __future__ import annotations

import torch

FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
INDEX_DTYPES = (torch.int32, torch.int64)


def require_triton(kernel: str, ref: str) -> None:
    """A clear error instead of a bare ImportError deep inside a launch."""
    try:
        import triton  # noqa: F401
    except ImportError as exc:
        raise RuntimeError(f"{kernel} needs triton, which cannot be imported ({exc}); use {ref}") from exc


def expect(cond: bool, message: str) -> None:
    if not cond:
        raise ValueError(message)


def check_tensor(name: str, t, ndim: int | tuple[int, ...], dtypes: tuple[torch.dtype, ...]) -> None:
    """`t` is a tensor with one of the allowed ranks and dtypes."""
    expect(isinstance(t, torch.Tensor), f"{name} must be a torch.Tensor, got {type(t).__name__}")
    ranks = (ndim,) if isinstance(ndim, int) else ndim
    expect(t.dim() in ranks, f"{name} must be {' or '.join(map(str, ranks))}-D, got shape {tuple(t.shape)}")
    names = ", ".join(str(d).removeprefix("torch.") for d in dtypes)
    expect(t.dtype in dtypes, f"{name} dtype must be one of ({names}), got {t.dtype}")


def check_dim(name: str, t: torch.Tensor, dim: int, size: int, what: str) -> None:
    expect(t.shape[dim] == size, f"{name}.shape[{dim}] must be {size} ({what}), got shape {tuple(t.shape)}")


def check_same_device(**tensors: torch.Tensor | None) -> torch.device:
    """All given tensors (None entries skipped) live on one device; returns it."""
    items = [(name, t) for name, t in tensors.items() if t is not None]
    device = items[0][1].device
    for name, t in items[1:]:
        expect(t.device == device, f"{name} is on {t.device} but {items[0][0]} is on {device}")
    return device


def check_contiguous(name: str, t: torch.Tensor) -> None:
    expect(t.is_contiguous(), f"{name} must be contiguous, got strides {t.stride()} for {tuple(t.shape)}")


def check_sm_scale(sm_scale) -> float:
    expect(isinstance(sm_scale, (int, float)) and not isinstance(sm_scale, bool) and sm_scale > 0,
           f"sm_scale must be a positive float, got {sm_scale!r}")
    return float(sm_scale)
