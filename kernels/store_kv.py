"""Scatter the K/V of new tokens into the paged KV pool: k_buffer[slots[i]] = k[i], v_buffer[slots[i]] = v[i].

Strategy: one program per (token, chunk of Hkv*D elements); each reads its token's slot once and copies one
contiguous row of the pool. The copy is memory-bound, so a chunk is a whole (Hkv*D) row up to 1024 elements.
"""

from __future__ import annotations

import torch

from ._checks import (
    FLOAT_DTYPES,
    INDEX_DTYPES,
    check_contiguous,
    check_same_device,
    check_tensor,
    expect,
    require_triton,
)


def _check_store_kv(k_buffer, v_buffer, slots, k, v) -> None:
    check_tensor("k_buffer", k_buffer, 3, FLOAT_DTYPES)
    check_tensor("v_buffer", v_buffer, 3, FLOAT_DTYPES)
    check_tensor("slots", slots, 1, INDEX_DTYPES)
    check_tensor("k", k, 3, FLOAT_DTYPES)
    check_tensor("v", v, 3, FLOAT_DTYPES)
    expect(v_buffer.shape == k_buffer.shape and v_buffer.dtype == k_buffer.dtype,
           f"v_buffer {tuple(v_buffer.shape)} {v_buffer.dtype} must match k_buffer "
           f"{tuple(k_buffer.shape)} {k_buffer.dtype}")
    check_contiguous("k_buffer", k_buffer)
    check_contiguous("v_buffer", v_buffer)
    row = tuple(k_buffer.shape[1:])
    expect(tuple(k.shape[1:]) == row, f"k must be (T, {row[0]}, {row[1]}) as the pool, got {tuple(k.shape)}")
    expect(v.shape == k.shape, f"v shape {tuple(v.shape)} must equal k shape {tuple(k.shape)}")
    expect(slots.shape[0] == k.shape[0], f"slots has {slots.shape[0]} entries but k has {k.shape[0]} tokens")
    expect(k.dtype == k_buffer.dtype and v.dtype == k_buffer.dtype,
           f"k/v dtype ({k.dtype}, {v.dtype}) must equal the pool dtype {k_buffer.dtype}")
    check_same_device(k_buffer=k_buffer, v_buffer=v_buffer, slots=slots, k=k, v=v)


def store_kv(k_buffer: torch.Tensor, v_buffer: torch.Tensor, slots: torch.Tensor,
             k: torch.Tensor, v: torch.Tensor) -> None:
    """In place. k_buffer, v_buffer (num_slots, Hkv, D) contiguous; slots (T,) int; k, v (T, Hkv, D).

    Slot values are not range-checked (that would need a device sync): they must lie in [0, num_slots).
    """
    _check_store_kv(k_buffer, v_buffer, slots, k, v)
    require_triton("store_kv", "store_kv_ref")
    from ._store_kv_triton import launch_store_kv

    launch_store_kv(k_buffer, v_buffer, slots, k, v)


def store_kv_ref(k_buffer: torch.Tensor, v_buffer: torch.Tensor, slots: torch.Tensor,
                 k: torch.Tensor, v: torch.Tensor) -> None:
    _check_store_kv(k_buffer, v_buffer, slots, k, v)
    index = slots.long()
    k_buffer.index_copy_(0, index, k)
    v_buffer.index_copy_(0, index, v)
