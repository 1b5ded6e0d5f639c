"""Imported by the `_*_triton` modules only, so at the first kernel launch, not by `import radixgen.kernels`.

Triton decides between compiling and interpreting when a `@triton.jit` decorator runs, so INTERPRET is read
once here, before those modules define their kernels, and it stays the truth for the whole process.
"""

from __future__ import annotations

import os

import torch
import triton

try:
    INTERPRET = bool(triton.knobs.runtime.interpret)
except AttributeError:  # triton < 3.3 has no knobs
    INTERPRET = os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "yes", "on")


def check_launchable(device: torch.device, kernel: str, ref: str) -> None:
    """Compiled Triton runs on CUDA tensors; CPU tensors only work under TRITON_INTERPRET=1."""
    if device.type == "cuda" or (INTERPRET and device.type == "cpu"):
        return
    raise ValueError(
        f"{kernel}: tensors are on {device}; the Triton kernel needs CUDA tensors "
        f"(or TRITON_INTERPRET=1 set before the first kernel launch). Use {ref} on the CPU."
    )


def next_pow2(n: int) -> int:
    return 1 << max(int(n) - 1, 0).bit_length()
