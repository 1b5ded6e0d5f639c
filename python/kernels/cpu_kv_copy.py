"""Row copies between two KV pools in C (csrc/cpu_kv_copy.h): the hierarchical cache's moves between the device pool
and its host tier, every layer's K and V in one call.

A pool keeps one buffer per layer and per K / V, so the torch path is a few ops per buffer: 60 buffers for a
30-layer model, ~600 small ops when a bf16 pool's rows are quantized into an int8 host tier (kv_quant's
quantize_kv_ref is ~8 ops). Their fixed cost, not the bytes, made a 700-token copy take ~20 ms; here it is one call
over arrays of the buffers' addresses. The conversions compute quantize_kv_ref's and dequantize_kv_ref's bits.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch

from . import cpu
from ._checks import expect
from .kv_quant import CODE_DTYPES, SCALE_DTYPE

VALUE_DTYPES = tuple(cpu.SUFFIX)  # float32, bfloat16
CODE = {torch.int8: 1, torch.float8_e4m3fn: 2}  # csrc/cpu_kv_quant.h's KV_INT8, KV_FP8


class PoolBuffers(NamedTuple):
    """One pool's buffers as the kernels take them: the arrays of their addresses (kept beside the tensors, which
    must stay alive), the element dtype and the row shape. A pool's buffers are fixed when it is made, so the runtime
    builds this once per pool (`pool_buffers`), not once per copy."""

    values: torch.Tensor  # (n_bufs,) int64: each buffer's address
    scales: torch.Tensor | None  # (n_bufs,) int64: each buffer's scales' address (8-bit codes), else None
    dtype: torch.dtype
    Hkv: int
    D: int
    tensors: tuple  # the buffers and scales themselves


def pool_buffers(buffers: Sequence[torch.Tensor], scales: Sequence[torch.Tensor] | None = None) -> PoolBuffers:
    """The unchecked PoolBuffers of buffers (rows, Hkv, D) and, for 8-bit codes, their scales (rows, Hkv)."""
    first = buffers[0]
    return PoolBuffers(_addresses(buffers), None if scales is None else _addresses(scales), first.dtype,
                       first.shape[1], first.shape[2], (*buffers, *(scales or ())))


def copy_rows(src: Sequence[torch.Tensor], src_index: torch.Tensor, dst: Sequence[torch.Tensor],
              dst_index: torch.Tensor, *, src_scales: Sequence[torch.Tensor] | None = None,
              dst_scales: Sequence[torch.Tensor] | None = None, threads: int = 1, kl=None) -> None:
    """dst[b][dst_index] = src[b][src_index] for every buffer b: buffers (rows, Hkv, D), contiguous CPU tensors,
    the same (Hkv, D) on both sides. Same dtype: a bit copy (8-bit codes with their bf16 scales (rows, Hkv) too);
    float32 / bfloat16 values -> 8-bit codes (int8 or float8_e4m3fn, `dst_scales` given): quantized as
    kv_quant.quantize_kv_ref; codes (`src_scales`) -> values: dequantized as dequantize_kv_ref. `threads` OpenMP
    threads (1: the calling thread alone); destination rows must be distinct."""
    expect(len(src) == len(dst) and len(src) > 0, f"src and dst must be lists of as many buffers, got {len(src)} "
                                                 f"and {len(dst)}")
    for name, idx, bufs in (("src_index", src_index, src), ("dst_index", dst_index, dst)):
        expect(isinstance(idx, torch.Tensor) and idx.dtype == torch.int64 and idx.dim() == 1
               and idx.device.type == "cpu", f"{name} must be a 1-D int64 CPU tensor")
        expect(not idx.numel() or (int(idx.min()) >= 0 and int(idx.max()) < bufs[0].shape[0]),
               f"{name} must lie in [0, {bufs[0].shape[0]})")
    expect(src_index.numel() == dst_index.numel(), f"{src_index.numel()} source rows for {dst_index.numel()} "
                                                   "destination rows")
    for name, bufs, scales in (("src", src, src_scales), ("dst", dst, dst_scales)):
        _check_buffers(name, bufs, src[0].shape[1:])
        expect((scales is not None) == (bufs[0].dtype in CODE_DTYPES),
               f"{name}_scales must be given exactly when {name} holds 8-bit codes")
        if scales is not None:
            expect(len(scales) == len(bufs), f"{name}_scales must have one tensor per buffer")
            for b, s in zip(bufs, scales, strict=True):
                expect(s.dtype == SCALE_DTYPE and s.shape == b.shape[:2] and s.is_contiguous()
                       and s.device.type == "cpu", f"{name}_scales must be contiguous (rows, Hkv) bfloat16 CPU "
                                                   "tensors")
    s_dt, d_dt = src[0].dtype, dst[0].dtype
    expect(s_dt == d_dt or (s_dt in VALUE_DTYPES and d_dt in CODE_DTYPES) or (s_dt in CODE_DTYPES
                                                                               and d_dt in VALUE_DTYPES),
           f"no conversion from {s_dt} to {d_dt}")
    expect(isinstance(threads, int) and threads >= 1, f"threads must be a positive int, got {threads!r}")
    kl = cpu._require(kl)
    expect(s_dt == d_dt or src[0].shape[2] <= kl.d_max, f"head_dim exceeds {kl.d_max}")
    _copy_rows(kl, pool_buffers(src, src_scales), src_index.contiguous(), pool_buffers(dst, dst_scales),
               dst_index.contiguous(), threads)


def _check_buffers(name: str, bufs: Sequence[torch.Tensor], rows: torch.Size) -> None:
    first = bufs[0]
    expect(first.dtype in VALUE_DTYPES + CODE_DTYPES, f"{name} dtype {first.dtype} is not a KV pool's")
    for b in bufs:
        expect(b.dim() == 3 and b.shape[1:] == rows and b.dtype == first.dtype and b.shape[0] == first.shape[0]
               and b.is_contiguous() and b.device.type == "cpu",
               f"{name} buffers must be alike contiguous (rows, {rows[0]}, {rows[1]}) CPU tensors")


def _addresses(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    return torch.tensor([t.data_ptr() for t in tensors], dtype=torch.int64)


def _copy_rows(kl, src: PoolBuffers, si: torch.Tensor, dst: PoolBuffers, di: torch.Tensor, threads: int) -> None:
    """The unchecked entry point (the runtime's, over pools alike by construction; indices contiguous int64)."""
    n = si.numel()
    if not n:
        return
    rows = dict(n_bufs=src.values.numel(), src_index=si.data_ptr(), dst_index=di.data_ptr(), n_rows=n,
                threads=threads)
    if src.dtype == dst.dtype:
        copy = kl.fn("rg_kv_copy_rows")
        copy(src=src.values.data_ptr(), dst=dst.values.data_ptr(),
             row_bytes=src.Hkv * src.D * src.dtype.itemsize, **rows)
        if src.scales is not None:
            copy(src=src.scales.data_ptr(), dst=dst.scales.data_ptr(), row_bytes=src.Hkv * SCALE_DTYPE.itemsize,
                 **rows)
    elif dst.dtype in CODE:
        kl.fn("kv_quantize_rows", cpu.SUFFIX[src.dtype])(
            src=src.values.data_ptr(), dst=dst.values.data_ptr(), dst_scale=dst.scales.data_ptr(), Hkv=src.Hkv,
            D=src.D, code=CODE[dst.dtype], **rows)
    else:
        kl.fn("kv_dequantize_rows", cpu.SUFFIX[dst.dtype])(
            src=src.values.data_ptr(), src_scale=src.scales.data_ptr(), dst=dst.values.data_ptr(), Hkv=src.Hkv,
            D=src.D, code=CODE[src.dtype], **rows)
