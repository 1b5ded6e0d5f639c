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


def check_kv_pool(k_buffer, v_buffer, k_scales, v_scales, dtypes: tuple[torch.dtype, ...]) -> bool:
    """K/V buffers (slots, Hkv, D), contiguous, alike: values of one of `dtypes`, or the codes of an 8-bit pool
    (kv_quant.CODE_DTYPES) with their bfloat16 scales (slots, Hkv), contiguous. Returns whether it is 8-bit."""
    from .kv_quant import CODE_DTYPES, SCALE_DTYPE

    check_tensor("k_buffer", k_buffer, 3, dtypes + CODE_DTYPES)
    check_tensor("v_buffer", v_buffer, 3, dtypes + CODE_DTYPES)
    expect(v_buffer.shape == k_buffer.shape and v_buffer.dtype == k_buffer.dtype,
           f"v_buffer {tuple(v_buffer.shape)} {v_buffer.dtype} must match k_buffer "
           f"{tuple(k_buffer.shape)} {k_buffer.dtype}")
    check_contiguous("k_buffer", k_buffer)
    check_contiguous("v_buffer", v_buffer)
    quantized = k_buffer.dtype in CODE_DTYPES
    for name, s in (("k_scales", k_scales), ("v_scales", v_scales)):
        if not quantized:
            expect(s is None, f"{name} are for an 8-bit pool; this one is {k_buffer.dtype}")
            continue
        expect(s is not None, f"an 8-bit pool ({k_buffer.dtype}) needs {name}")
        check_tensor(name, s, 2, (SCALE_DTYPE,))
        expect(tuple(s.shape) == tuple(k_buffer.shape[:2]),
               f"{name} must be (slots, kv heads) = {tuple(k_buffer.shape[:2])}, got {tuple(s.shape)}")
        check_contiguous(name, s)
    return quantized
