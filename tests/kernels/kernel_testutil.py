"""Shared builders for the kernel tests: device choice, error metric, a shuffled KV pool."""

from __future__ import annotations

from typing import NamedTuple

import torch

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
TOL = {torch.float32: 1e-3, torch.bfloat16: 1e-2, torch.float16: 1e-2}


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """||out - ref|| / ||ref||, NaN-aware: any NaN or inf in out gives inf."""
    out, ref = out.double(), ref.double()
    if not torch.isfinite(out).all():
        return float("inf")
    return ((out - ref).norm() / ref.norm()).item()


class Pool(NamedTuple):
    k_buffer: torch.Tensor  # (num_slots, Hkv, D)
    v_buffer: torch.Tensor
    req_to_slot: torch.Tensor  # (max_reqs, max_context_len)
    req_indices: torch.Tensor  # (B,) rows of req_to_slot, shuffled


def make_pool(lens: list[int], num_kv_heads: int, head_dim: int, dtype: torch.dtype, *,
              max_reqs: int = 6, max_context_len: int = 96, index_dtype: torch.dtype = torch.int64,
              gen: torch.Generator) -> Pool:
    """A pool with random K/V whose request b holds lens[b] tokens in randomly permuted slots (never slot 0),
    in a random table row. Table entries past a request's length point at other requests' slots, so a kernel
    reading past the length gets a wrong answer rather than a lucky one."""
    total = sum(lens)
    num_slots = total + 9  # a few never-used slots besides the padding slot 0
    shape = (num_slots, num_kv_heads, head_dim)
    k_buffer = torch.randn(shape, generator=gen).to(dtype)
    v_buffer = torch.randn(shape, generator=gen).to(dtype)
    slots = torch.randperm(num_slots - 1, generator=gen)[:total] + 1
    req_to_slot = torch.randint(1, num_slots, (max_reqs, max_context_len), generator=gen)
    rows = torch.randperm(max_reqs, generator=gen)[: len(lens)]
    start = 0
    for row, n in zip(rows.tolist(), lens, strict=True):
        req_to_slot[row, :n] = slots[start:start + n]
        start += n
    return Pool(k_buffer.to(DEVICE), v_buffer.to(DEVICE), req_to_slot.to(index_dtype).to(DEVICE),
                rows.to(index_dtype).to(DEVICE))


def lens_tensor(values: list[int], dtype: torch.dtype = torch.int64) -> torch.Tensor:
    return torch.tensor(values, dtype=dtype, device=DEVICE)


CODE_DTYPES = [torch.int8, torch.float8_e4m3fn]


class QuantizedPool(NamedTuple):
    pool: Pool  # the table and rows; its buffers hold the values the codes were made from
    k_codes: torch.Tensor  # (num_slots, Hkv, D) int8 / float8_e4m3fn
    v_codes: torch.Tensor
    k_scales: torch.Tensor  # (num_slots, Hkv) bfloat16
    v_scales: torch.Tensor

    def scales(self) -> dict:
        return {"k_scales": self.k_scales, "v_scales": self.v_scales}


def quantize_pool(pool: Pool, code_dtype: torch.dtype) -> QuantizedPool:
    """make_pool's pool as an 8-bit pool (kv_quant's reference quantization of every slot)."""
    from radixgen.kernels.kv_quant import quantize_kv_ref

    (kc, ks), (vc, vs) = (quantize_kv_ref(b.cpu(), code_dtype) for b in (pool.k_buffer, pool.v_buffer))
    return QuantizedPool(pool, kc.to(DEVICE), vc.to(DEVICE), ks.to(DEVICE), vs.to(DEVICE))
