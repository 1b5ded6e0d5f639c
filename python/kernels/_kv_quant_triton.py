"""Triton helpers of 8-bit KV pools (kv_quant.py's formats), shared by the store and attention kernels.

The roundings are done with integer operations rather than dtype casts: on the GPU a cast to bf16 or fp8 rounds
to nearest even, but the interpreter truncates (and mishandles fp8 subnormals), and the codes must be the torch
reference's bit for bit on both. fp8 pools are passed as uint8 views (codes by their bits).
"""

from __future__ import annotations

import triton
import triton.language as tl

PLAIN, INT8, FP8 = 0, 1, 2  # the FORMAT constexpr of the kernels


@triton.jit
def _rint(x):
    # nearest even for |x| < 2^22: adding 1.5 * 2^23 leaves no fraction bits, the hardware rounds
    return (x + 12582912.0) - 12582912.0


@triton.jit
def _bf16_round(x):
    # float32 rounded to bf16 precision (nearest even), still float32
    u = x.to(tl.uint32, bitcast=True)
    u = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16) << 16
    return u.to(tl.float32, bitcast=True)


@triton.jit
def _e4m3_encode(y):
    # |y| <= 448 -> e4m3 code bits (csrc/cpu_kv_quant.h's f32_to_e4m3)
    u = y.to(tl.uint32, bitcast=True)
    sign = (u >> 24) & 0x80
    u = u & 0x7FFFFFFF
    a = u.to(tl.float32, bitcast=True)
    sub = _rint(a * 512.0).to(tl.uint32)  # below 2^-6: multiples of 2^-9
    normal = ((u + 0x7FFFF + ((u >> 20) & 1)) >> 20) - 960  # mantissa to 3 bits, exponent bias 127 -> 7
    return (sign | tl.where(a < 0.015625, sub, normal)).to(tl.uint8)


@triton.jit
def _e4m3_decode(c):
    c = c.to(tl.uint32)
    e = (c >> 3) & 15
    m = c & 7
    normal = (((e + 120) << 23) | (m << 20)).to(tl.float32, bitcast=True)
    v = tl.where(e == 0, m.to(tl.float32) * 0.001953125, normal)
    return tl.where((c & 0x80) != 0, -v, v)


@triton.jit
def kv_values(codes, FORMAT: tl.constexpr):
    """Codes as loaded -> their float32 values before the scale."""
    if FORMAT == 2:
        return _e4m3_decode(codes)
    return codes.to(tl.float32)


@triton.jit
def quantize_rows(x, FORMAT: tl.constexpr):
    """x (R, D) float32 (masked-off elements 0) -> (codes (R, D) for the pool, scales (R,) float32 bf16-exact)."""
    QMAX: tl.constexpr = 127.0 if FORMAT == 1 else 448.0
    amax = tl.max(tl.abs(x), 1)
    scale = _bf16_round(tl.math.div_rn(amax, tl.full(amax.shape, QMAX, tl.float32)))  # IEEE division, as torch's
    s = tl.broadcast_to(scale[:, None], x.shape)
    y = tl.where(s > 0, tl.math.div_rn(x, tl.where(s > 0, s, 1.0)), 0.0)
    y = tl.minimum(tl.maximum(y, -QMAX), QMAX)
    if FORMAT == 1:
        codes = _rint(y).to(tl.int8)
    else:
        codes = _e4m3_encode(y)
    return codes, scale


def format_of(k_buffer, quantized: bool) -> int:
    import torch

    return (FP8 if k_buffer.dtype == torch.float8_e4m3fn else INT8) if quantized else PLAIN


def pool_views(k_buffer, v_buffer, k_scales, v_scales):
    """The tensors a kernel reads: fp8 codes as uint8; without scales, the buffers stand in (never read)."""
    import torch

    if k_buffer.dtype == torch.float8_e4m3fn:
        k_buffer, v_buffer = k_buffer.view(torch.uint8), v_buffer.view(torch.uint8)
    if k_scales is None:
        return k_buffer, v_buffer, k_buffer, v_buffer, 0
    return k_buffer, v_buffer, k_scales, v_scales, k_scales.stride(0)

