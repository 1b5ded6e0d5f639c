"""Dequantizing matmuls for CUDA (Triton): y (M, N) = x (M, K) @ W^T (+ bias) where W is stored quantized and
dequantized tile by tile in registers, each beside its torch reference (`<name>_ref`, the same signature).

- awq_matmul: AutoAWQ's GEMM layout: qweight (K, N / 8) and qzeros (K / group, N / 8) int32, eight 4-bit values
  per int32 along the output dim, nibble i holding output column 8c + AWQ_ORDER[i]; scales (K / group, N);
  w = scale * (q - zero).
- gptq_matmul: AutoGPTQ's: qweight (K / 8, N) int32 along the input dim (nibble i of row r is input 8r + i),
  qzeros (K / group, N / 8) int32 along the output dim, zero = stored + zero_offset (1 in the v1 format); scales
  (G, N); g_idx (K,) int32, the group of each input row (any order: activation-order checkpoints scatter them).
- int8_matmul: values (N, K) int8, scales (N,) float32; w = scale * q.
- fp8_matmul: values (N, K) float8_e4m3fn, scales (N,) float32; w = scale * value.

Every one computes in float32 and rounds once to x's dtype. batch_invariant=True (the deterministic mode) keeps
one tile shape whatever M, so a row's bits do not depend on how many rows share the call (the default narrows
the row tile for decode-sized calls). Strategy: one program per (BM rows, BN columns)
tile of y, looping over K in BK steps: the x tile, the weight tile unpacked and scaled (int8 / fp8: scaled per
column after the loop) in x's dtype, one tl.dot into a float32 accumulator. FP8 values are decoded from their
bits (exact in bf16 and fp32), which also runs under the interpreter.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ._checks import FLOAT_DTYPES, check_contiguous, check_same_device, check_tensor, expect, require_triton

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
_SHIFTS = torch.arange(0, 32, 4, dtype=torch.int32)
MODES = {"awq": 0, "gptq": 1, "int8": 2, "fp8": 3}


def unpack_cols(packed: torch.Tensor) -> torch.Tensor:
    """(R, C) int32 -> (R, 8 C) uint8, nibble i (bits 4i .. 4i + 3) of column c becoming column 8c + i."""
    return ((packed[..., None] >> _SHIFTS.to(packed.device)) & 15).reshape(packed.shape[0], -1).to(torch.uint8)


def unpack_rows(packed: torch.Tensor) -> torch.Tensor:
    """(R, C) int32 -> (8 R, C) uint8, nibble i of row r becoming row 8r + i (GPTQ's qweight)."""
    nibbles = (packed[:, None, :] >> _SHIFTS.to(packed.device)[None, :, None]) & 15  # (R, 8, C)
    return nibbles.reshape(-1, packed.shape[1]).to(torch.uint8)


def unpack_awq(packed: torch.Tensor) -> torch.Tensor:
    """(R, C) int32 -> (R, 8 C) uint8 in output-column order: nibble i of column c is column 8c + AWQ_ORDER[i]."""
    nibbles = unpack_cols(packed).view(packed.shape[0], -1, 8)
    out = torch.empty_like(nibbles)
    out[..., list(AWQ_ORDER)] = nibbles
    return out.view(packed.shape[0], -1)


def _check_x(x: torch.Tensor, k: int, bias: torch.Tensor | None, n: int) -> None:
    check_tensor("x", x, 2, FLOAT_DTYPES)
    expect(x.shape[1] == k and x.stride(1) == 1, f"x must be (M, {k}) with unit stride along K, got {tuple(x.shape)}")
    if bias is not None:
        check_tensor("bias", bias, 1, (x.dtype,))
        expect(bias.shape[0] == n and bias.stride(0) == 1, f"bias must be ({n},) contiguous, got {tuple(bias.shape)}")


def _check_packed4(qweight, qzeros, scales, k: int, n: int, group: int) -> None:
    expect(isinstance(group, int) and group > 0 and k % group == 0, f"group {group!r} must divide K = {k}")
    check_tensor("qzeros", qzeros, 2, (torch.int32,))
    check_tensor("scales", scales, 2, FLOAT_DTYPES)
    expect(tuple(qzeros.shape) == (k // group, n // 8), f"qzeros must be ({k // group}, {n // 8}), got "
           f"{tuple(qzeros.shape)}")
    expect(tuple(scales.shape) == (k // group, n), f"scales must be ({k // group}, {n}), got {tuple(scales.shape)}")
    for name, t in (("qweight", qweight), ("qzeros", qzeros), ("scales", scales)):
        check_contiguous(name, t)


def awq_matmul(x, qweight, qzeros, scales, group: int, bias=None, *, batch_invariant: bool = False) -> torch.Tensor:
    check_tensor("qweight", qweight, 2, (torch.int32,))
    k, n = qweight.shape[0], qweight.shape[1] * 8
    _check_x(x, k, bias, n)
    _check_packed4(qweight, qzeros, scales, k, n, group)
    check_same_device(x=x, qweight=qweight, qzeros=qzeros, scales=scales, bias=bias)
    return _launch("awq", x, qweight, qzeros, scales, None, bias, n, group, 0, batch_invariant)


def awq_matmul_ref(x, qweight, qzeros, scales, group: int, bias=None) -> torch.Tensor:
    q, z = unpack_awq(qweight).float(), unpack_awq(qzeros).float().repeat_interleave(group, 0)
    w = (q - z) * scales.float().repeat_interleave(group, 0)  # (K, N)
    return F.linear(x.float(), w.t(), None if bias is None else bias.float()).to(x.dtype)


def gptq_matmul(x, qweight, qzeros, scales, g_idx, zero_offset: int, bias=None, *,
                batch_invariant: bool = False) -> torch.Tensor:
    check_tensor("qweight", qweight, 2, (torch.int32,))
    k, n = qweight.shape[0] * 8, qweight.shape[1]
    _check_x(x, k, bias, n)
    check_tensor("g_idx", g_idx, 1, (torch.int32,))
    expect(g_idx.shape[0] == k and g_idx.is_contiguous(), f"g_idx must be ({k},) contiguous")
    groups = scales.shape[0] if scales.dim() == 2 else 0
    expect(groups > 0 and k % groups == 0, f"scales must be (groups, {n}) with groups dividing {k}")
    _check_packed4(qweight, qzeros, scales, k, n, k // groups)
    check_same_device(x=x, qweight=qweight, qzeros=qzeros, scales=scales, g_idx=g_idx, bias=bias)
    return _launch("gptq", x, qweight, qzeros, scales, g_idx, bias, n, 1, int(zero_offset), batch_invariant)


def gptq_matmul_ref(x, qweight, qzeros, scales, g_idx, zero_offset: int, bias=None) -> torch.Tensor:
    q = unpack_rows(qweight).float()  # (K, N)
    z = unpack_cols(qzeros).float() + zero_offset  # (G, N)
    g = g_idx.long()
    w = (q - z[g]) * scales.float()[g]
    return F.linear(x.float(), w.t(), None if bias is None else bias.float()).to(x.dtype)


def _check_rows(name: str, values, scales, x, bias, dtype) -> int:
    check_tensor(name, values, 2, (dtype,))
    check_contiguous(name, values)
    n, k = values.shape
    _check_x(x, k, bias, n)
    check_tensor("scales", scales, 1, (torch.float32,))
    expect(scales.shape[0] == n and scales.is_contiguous(), f"scales must be ({n},) float32 contiguous")
    check_same_device(x=x, values=values, scales=scales, bias=bias)
    return n


def int8_matmul(x, qweight, scales, bias=None, *, batch_invariant: bool = False) -> torch.Tensor:
    n = _check_rows("qweight", qweight, scales, x, bias, torch.int8)
    return _launch("int8", x, qweight, None, scales, None, bias, n, 1, 0, batch_invariant)


def int8_matmul_ref(x, qweight, scales, bias=None) -> torch.Tensor:
    w = qweight.float() * scales[:, None]
    return F.linear(x.float(), w, None if bias is None else bias.float()).to(x.dtype)


def fp8_matmul(x, qweight, scales, bias=None, *, batch_invariant: bool = False) -> torch.Tensor:
    n = _check_rows("qweight", qweight, scales, x, bias, torch.float8_e4m3fn)
    return _launch("fp8", x, qweight.view(torch.uint8), None, scales, None, bias, n, 1, 0, batch_invariant)


def fp8_matmul_ref(x, qweight, scales, bias=None) -> torch.Tensor:
    w = qweight.float() * scales[:, None]
    return F.linear(x.float(), w, None if bias is None else bias.float()).to(x.dtype)


def _launch(mode: str, x, w, z, s, g, bias, n: int, group: int, zero_offset: int,
            batch_invariant: bool) -> torch.Tensor:
    require_triton(f"{mode}_matmul", f"{mode}_matmul_ref")
    from ._quant_matmul_triton import launch_dequant_matmul

    return launch_dequant_matmul(MODES[mode], x, w, z, s, g, bias, n, group, zero_offset, f"{mode}_matmul",
                                 batch_invariant)
