"""8-bit KV pools: the code formats and their plain-torch quantize / dequantize, the reference of every kernel.

A quantized pool keeps, per layer, K and V codes (slots, Hkv, D) and one bfloat16 scale per (slot, KV head)
(slots, Hkv): value = code * scale. Each (token, head) row of D values is quantized on its own when it is
stored, symmetric around 0 with scale = amax / QMAX (amax: the row's largest magnitude), and never re-scaled:

- int8: codes round(x / scale) in [-127, 127] (nearest even);
- fp8 e4m3 (torch.float8_e4m3fn): codes x / scale rounded to e4m3 (nearest even), |x / scale| <= 448.

Why per (token, head): a token's K/V are written once and then read by every later step and, through the radix
tree, by other requests, so a scale must be fixed when the row is written; per-tensor or per-channel scales
would need calibration data or re-scaling old slots when a larger value comes. A per-token scale follows the
large-norm tokens (the first token of a sequence often has K/V an order of magnitude above the rest) without
costing the others precision. The scale is bfloat16 (2 bytes beside D code bytes: the pool holds
2D / (D + 2) times the tokens of a 16-bit pool, 1.94x at D = 64, 1.97x at D = 128); its rounding costs no
accuracy, as the codes are computed from the rounded scale.

Every kernel (C, Triton) computes the same codes bit for bit as `quantize_kv_ref` (float32 arithmetic: amax /
QMAX rounded to bf16, x / scale rounded); readers dequantize in float32, or, where a kernel works in bf16 (the
torch backend, the C extend kernel's packed blocks), round code * scale to the model dtype.
"""

from __future__ import annotations

import torch

# an 8-bit pool's code dtype -> the largest code magnitude; name suffix of the C kernels
QMAX = {torch.int8: 127.0, torch.float8_e4m3fn: 448.0}
CODE_DTYPES = tuple(QMAX)
C_SUFFIX = {torch.int8: "i8", torch.float8_e4m3fn: "f8"}
SCALE_DTYPE = torch.bfloat16


def is_quantized(buffer: torch.Tensor) -> bool:
    return buffer.dtype in QMAX


def code_bits(codes: torch.Tensor) -> torch.Tensor:
    """fp8 codes as uint8 (torch's CPU index_copy_ / index_select do not take float8), other codes as they are."""
    return codes.view(torch.uint8) if codes.dtype == torch.float8_e4m3fn else codes


def gather_codes(codes: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """codes.index_select(0, index), for any code dtype."""
    return code_bits(codes).index_select(0, index).view(codes.dtype)


def quantize_kv_ref(x: torch.Tensor, code_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """x (..., D) float -> (codes (..., D) of code_dtype, scales (...) bfloat16), one scale per row of D."""
    xf = x.float()
    scale = (xf.abs().amax(-1) / QMAX[code_dtype]).to(SCALE_DTYPE)
    s = scale.float().unsqueeze(-1)
    y = torch.where(s > 0, xf / s, torch.zeros_like(xf)).clamp(-QMAX[code_dtype], QMAX[code_dtype])
    codes = y.round().to(torch.int8) if code_dtype == torch.int8 else y.to(code_dtype)
    return codes, scale


def dequantize_kv_ref(codes: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """codes (..., D), scales (...) -> values (..., D) in dtype (the product computed in float32)."""
    return (codes.float() * scales.float().unsqueeze(-1)).to(dtype)


def store_rows_ref(buffer: torch.Tensor, scales: torch.Tensor | None, index: torch.Tensor, x: torch.Tensor) -> None:
    """buffer[index] = x (T, Hkv, D); for an 8-bit pool (scales given) x's codes, and scales[index] their scales."""
    if scales is None:
        buffer.index_copy_(0, index, x)
        return
    codes, s = quantize_kv_ref(x, buffer.dtype)
    code_bits(buffer).index_copy_(0, index, code_bits(codes))
    scales.index_copy_(0, index, s)


def gather_rows(buffer: torch.Tensor, scales: torch.Tensor | None, index: torch.Tensor,
                dtype: torch.dtype) -> torch.Tensor:
    """The pool rows buffer[index] (N, Hkv, D) as values in dtype: as stored, or dequantized."""
    if scales is None:
        return buffer.index_select(0, index).to(dtype)
    return dequantize_kv_ref(gather_codes(buffer, index), scales.index_select(0, index), dtype)
