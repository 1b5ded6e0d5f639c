"""Segmented LoRA matmuls over a batch whose rows belong to several adapters (the Punica / S-LoRA "SGMV" shape):
shrink h = x @ A^T, then expand y += (h @ B) * scale, each adapter's rows at once, never one forward per adapter.

The rows of one adapter need not be contiguous: `rows` lists the batch's adapter rows grouped by adapter, and
segment i is rows[seg_starts[i] : seg_starts[i] + seg_lens[i]], all with adapter slot seg_slots[i]. Adapters'
weights live stacked in a pool: a (S, NR, K) with NR = segments * R (the shrink of a merged projection, e.g.
q|k|v, is one matmul), b (S, R, N) (its expand, read per output segment at a rank offset). Roundings follow
the unfused torch path: h rounded to the dtype, the expand rounded, times the scale rounded, then added.

Strategy: one program per (segment, block of rows, block of outputs); the segment's slot selects the weights,
rows are gathered by index (no copy of x), and each output row belongs to one segment (no atomics).
"""

from __future__ import annotations

import torch

from ._checks import FLOAT_DTYPES, INDEX_DTYPES, check_same_device, check_tensor, expect, require_triton


def _check_segments(rows, seg_starts, seg_lens, seg_slots, max_len) -> None:
    for name, t in (("rows", rows), ("seg_starts", seg_starts), ("seg_lens", seg_lens), ("seg_slots", seg_slots)):
        check_tensor(name, t, 1, INDEX_DTYPES)
    expect(seg_starts.shape == seg_lens.shape == seg_slots.shape,
           f"seg_starts, seg_lens and seg_slots must have one entry per segment, got {tuple(seg_starts.shape)}, "
           f"{tuple(seg_lens.shape)}, {tuple(seg_slots.shape)}")
    expect(isinstance(max_len, int) and not isinstance(max_len, bool) and max_len >= 0,
           f"max_len must be an int >= 0 (the longest segment), got {max_len!r}")


def _check_shrink(x, a, rows, seg_starts, seg_lens, seg_slots, max_len) -> None:
    check_tensor("x", x, 2, FLOAT_DTYPES)
    check_tensor("a", a, 3, FLOAT_DTYPES)
    expect(a.dtype == x.dtype, f"a dtype {a.dtype} must equal x dtype {x.dtype}")
    expect(a.shape[2] == x.shape[1], f"a (S, NR, K) must have K = {x.shape[1]} (x's columns), got {tuple(a.shape)}")
    expect(x.stride(1) == 1 and a.is_contiguous(), "x needs unit stride along its columns and a must be contiguous")
    _check_segments(rows, seg_starts, seg_lens, seg_slots, max_len)
    check_same_device(x=x, a=a, rows=rows, seg_starts=seg_starts, seg_lens=seg_lens, seg_slots=seg_slots)


def lora_shrink(x: torch.Tensor, a: torch.Tensor, rows: torch.Tensor, seg_starts: torch.Tensor,
                seg_lens: torch.Tensor, seg_slots: torch.Tensor, max_len: int) -> torch.Tensor:
    """x (T, K); a (S, NR, K) contiguous, x's dtype -> h (T, NR) in x's dtype: for every row r of segment i,
    h[r] = x[r] @ a[seg_slots[i]]^T; rows in no segment are zero. max_len: the longest segment (sizes the grid
    without reading the lengths back)."""
    _check_shrink(x, a, rows, seg_starts, seg_lens, seg_slots, max_len)
    require_triton("lora_shrink", "lora_shrink_ref")
    from ._lora_triton import launch_shrink

    return launch_shrink(x, a, rows, seg_starts, seg_lens, seg_slots, max_len)


def lora_shrink_ref(x: torch.Tensor, a: torch.Tensor, rows: torch.Tensor, seg_starts: torch.Tensor,
                    seg_lens: torch.Tensor, seg_slots: torch.Tensor, max_len: int) -> torch.Tensor:
    _check_shrink(x, a, rows, seg_starts, seg_lens, seg_slots, max_len)
    h = torch.zeros((x.shape[0], a.shape[1]), dtype=x.dtype, device=x.device)
    for start, n, slot in zip(seg_starts.tolist(), seg_lens.tolist(), seg_slots.tolist(), strict=True):
        idx = rows[start:start + n].long()
        h[idx] = x[idx] @ a[slot].t()
    return h


def expand_weights(b: torch.Tensor, slot: int, col0: int, col1: int) -> torch.Tensor:
    """Slot `slot`'s expand matrix (R, col1 - col0) from b (S, R/2, N, 2) (a copy)."""
    pairs = b[slot, :, col0:col1, :]  # (R/2, C, 2)
    return pairs.permute(0, 2, 1).reshape(2 * b.shape[1], col1 - col0)


def _check_expand(y, h, b, scales, rows, seg_starts, seg_lens, seg_slots, max_len, col0, col1, rank_offset):
    check_tensor("y", y, 2, FLOAT_DTYPES)
    check_tensor("h", h, 2, FLOAT_DTYPES)
    check_tensor("b", b, 4, FLOAT_DTYPES)
    check_tensor("scales", scales, 1, (torch.float32,))
    expect(h.dtype == y.dtype and b.dtype == y.dtype, f"h and b must have y's dtype {y.dtype}")
    expect(b.shape[3] == 2, f"b must be (S, R/2, N, 2) (ranks in pairs), got {tuple(b.shape)}")
    expect(h.shape[0] == y.shape[0], f"h has {h.shape[0]} rows but y has {y.shape[0]}")
    expect(0 <= col0 <= col1 <= y.shape[1] and b.shape[2] >= col1,
           f"columns [{col0}, {col1}) must lie in y's {y.shape[1]} and b's {b.shape[2]}")
    expect(0 <= rank_offset and rank_offset + 2 * b.shape[1] <= h.shape[1],
           f"ranks [{rank_offset}, {rank_offset + 2 * b.shape[1]}) must lie in h's {h.shape[1]} columns")
    expect(scales.shape[0] == b.shape[0], f"scales has {scales.shape[0]} entries for {b.shape[0]} slots")
    expect(y.stride(1) == 1 and h.stride(1) == 1 and b.is_contiguous(),
           "y and h need unit stride along their columns and b must be contiguous")
    _check_segments(rows, seg_starts, seg_lens, seg_slots, max_len)
    check_same_device(y=y, h=h, b=b, scales=scales, rows=rows, seg_starts=seg_starts)


def lora_expand_(y: torch.Tensor, h: torch.Tensor, b: torch.Tensor, scales: torch.Tensor, rows: torch.Tensor,
                 seg_starts: torch.Tensor, seg_lens: torch.Tensor, seg_slots: torch.Tensor, max_len: int,
                 col0: int, col1: int, rank_offset: int) -> None:
    """In place: for every row r of segment i (slot s = seg_slots[i]),
    y[r, col0:col1] += (h[r, rank_offset : rank_offset + R] @ B_s[:, col0:col1]) * scales[s], with b (S, R/2, N, 2)
    contiguous (B_s = expand_weights(b, s, ...)) and h, b in y's dtype; scales (S,) float32."""
    _check_expand(y, h, b, scales, rows, seg_starts, seg_lens, seg_slots, max_len, col0, col1, rank_offset)
    require_triton("lora_expand_", "lora_expand_ref_")
    from ._lora_triton import launch_expand

    launch_expand(y, h, b, scales, rows, seg_starts, seg_lens, seg_slots, max_len, col0, col1, rank_offset)


def lora_expand_ref_(y: torch.Tensor, h: torch.Tensor, b: torch.Tensor, scales: torch.Tensor, rows: torch.Tensor,
                     seg_starts: torch.Tensor, seg_lens: torch.Tensor, seg_slots: torch.Tensor, max_len: int,
                     col0: int, col1: int, rank_offset: int) -> None:
    _check_expand(y, h, b, scales, rows, seg_starts, seg_lens, seg_slots, max_len, col0, col1, rank_offset)
    r = 2 * b.shape[1]
    for start, n, slot in zip(seg_starts.tolist(), seg_lens.tolist(), seg_slots.tolist(), strict=True):
        idx = rows[start:start + n].long()
        d = h[idx, rank_offset:rank_offset + r] @ expand_weights(b, slot, col0, col1)
        y[idx, col0:col1] += d * scales[slot].item()
