"""Scatter the K/V of new tokens into the paged KV pool: k_buffer[slots[i]] = k[i], v_buffer[slots[i]] = v[i].

Strategy: one program per (token, chunk of Hkv*D elements); each reads its token's slot once and copies one
contiguous row of the pool. The copy is memory-bound, so a chunk is a whole (Hkv*D) row up to 1024 elements.
An 8-bit pool: one program per token quantizes its (Hkv, D) row, head by head (a scale per (token, head)).
"""

from __future__ import annotations

import torch

from ._checks import (
    FLOAT_DTYPES,
    INDEX_DTYPES,
    check_kv_pool,
    check_same_device,
    check_tensor,
    expect,
    require_triton,
)
from .kv_quant import store_rows_ref


def _check_store_kv(k_buffer, v_buffer, slots, k, v, k_scales, v_scales) -> None:
    quantized = check_kv_pool(k_buffer, v_buffer, k_scales, v_scales, FLOAT_DTYPES)
    check_tensor("slots", slots, 1, INDEX_DTYPES)
    check_tensor("k", k, 3, FLOAT_DTYPES)
    check_tensor("v", v, 3, FLOAT_DTYPES)
    row = tuple(k_buffer.shape[1:])
    expect(tuple(k.shape[1:]) == row, f"k must be (T, {row[0]}, {row[1]}) as the pool, got {tuple(k.shape)}")
    expect(v.shape == k.shape, f"v shape {tuple(v.shape)} must equal k shape {tuple(k.shape)}")
    expect(slots.shape[0] == k.shape[0], f"slots has {slots.shape[0]} entries but k has {k.shape[0]} tokens")
    if quantized:
        expect(v.dtype == k.dtype, f"k and v dtypes ({k.dtype}, {v.dtype}) must match")
    else:
        expect(k.dtype == k_buffer.dtype and v.dtype == k_buffer.dtype,
               f"k/v dtype ({k.dtype}, {v.dtype}) must equal the pool dtype {k_buffer.dtype}")
    check_same_device(k_buffer=k_buffer, v_buffer=v_buffer, slots=slots, k=k, v=v, k_scales=k_scales,
                      v_scales=v_scales)


def store_kv(k_buffer: torch.Tensor, v_buffer: torch.Tensor, slots: torch.Tensor,
             k: torch.Tensor, v: torch.Tensor, *, k_scales: torch.Tensor | None = None,
             v_scales: torch.Tensor | None = None) -> None:
    """In place. k_buffer, v_buffer (num_slots, Hkv, D) contiguous; slots (T,) int; k, v (T, Hkv, D).
    An 8-bit pool (int8 / float8_e4m3fn codes) takes its bfloat16 scales (num_slots, Hkv) as k_scales / v_scales
    and stores each (token, head) row quantized (radixgen.kernels.kv_quant).

    Slot values are not range-checked (that would need a device sync): they must lie in [0, num_slots).
    """
    _check_store_kv(k_buffer, v_buffer, slots, k, v, k_scales, v_scales)
    require_triton("store_kv", "store_kv_ref")
    from ._store_kv_triton import launch_store_kv

    launch_store_kv(k_buffer, v_buffer, slots, k, v, k_scales, v_scales)


def store_kv_ref(k_buffer: torch.Tensor, v_buffer: torch.Tensor, slots: torch.Tensor,
                 k: torch.Tensor, v: torch.Tensor, *, k_scales: torch.Tensor | None = None,
                 v_scales: torch.Tensor | None = None) -> None:
    _check_store_kv(k_buffer, v_buffer, slots, k, v, k_scales, v_scales)
    index = slots.long()
    store_rows_ref(k_buffer, k_scales, index, k)
    store_rows_ref(v_buffer, v_scales, index, v)
