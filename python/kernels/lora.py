"""Segmented LoRA matmuls over a batch whose rows belong to several adapters (the Punica / S-LoRA "SGMV" shape):
shrink h = x @ A^T, then expand y += (h @ B) * scale, each adapter's rows at once, never one forward per adapter.

The rows of one adapter need not be contiguous: `rows` lists the batch's adapter rows grouped by adapter, and
segment i is rows[seg_starts[i] : seg_starts[i] + seg_lens[i]], all with adapter slot seg_slots[i]. Adapters'
weights live stacked in a pool, both in "K-pair blocks" of 16 (`pack_kpairs`): a block holds 16 rows of a matrix,
its columns in pairs, t[blk, p, j, c] being the matrix's entry (row 16 blk + j, column 2p + c), the layout the CPU
kernels stream a block of in one run, two values of the reduced dimension per instruction:
  a (S, ceil(NR/16), K/2, 16, 2): each slot's shrink matrix A (NR, K), NR = segments * R (the shrink of a
     merged projection, e.g. q|k|v, is one matmul); h has 16 ceil(NR/16) columns, the last ones zero
  b (S, ceil(N/16), R/2, 16, 2): each slot's B^T (N rows, R columns), the expand, read per output segment at a
     rank offset; R even.
`unpack_kpairs` gives the plain matrices back. Roundings follow the unfused torch path: h rounded to the dtype,
the expand rounded, times the scale rounded, then added.

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
    check_tensor("a", a, 5, FLOAT_DTYPES)
    expect(a.dtype == x.dtype, f"a dtype {a.dtype} must equal x dtype {x.dtype}")
    expect(2 * a.shape[2] == x.shape[1] and a.shape[3:] == (16, 2),
           f"a (S, NR/16, K/2, 16, 2) must have K = {x.shape[1]} (x's columns), got {tuple(a.shape)}")
    expect(x.stride(1) == 1 and a.is_contiguous(), "x needs unit stride along its columns and a must be contiguous")
    _check_segments(rows, seg_starts, seg_lens, seg_slots, max_len)
    check_same_device(x=x, a=a, rows=rows, seg_starts=seg_starts, seg_lens=seg_lens, seg_slots=seg_slots)


def lora_shrink(x: torch.Tensor, a: torch.Tensor, rows: torch.Tensor, seg_starts: torch.Tensor,
                seg_lens: torch.Tensor, seg_slots: torch.Tensor, max_len: int) -> torch.Tensor:
    """x (T, K); a (S, NB, K/2, 16, 2) contiguous, x's dtype -> h (T, 16 NB) in x's dtype: for every row r of
    segment i, h[r] = x[r] @ A_s^T with A_s = unpack_kpairs(a[seg_slots[i]]); rows in no segment are zero.
    max_len: the longest segment (sizes the grid without reading the lengths back)."""
    _check_shrink(x, a, rows, seg_starts, seg_lens, seg_slots, max_len)
    require_triton("lora_shrink", "lora_shrink_ref")
    from ._lora_triton import launch_shrink

    return launch_shrink(x, a, rows, seg_starts, seg_lens, seg_slots, max_len)


def lora_shrink_ref(x: torch.Tensor, a: torch.Tensor, rows: torch.Tensor, seg_starts: torch.Tensor,
                    seg_lens: torch.Tensor, seg_slots: torch.Tensor, max_len: int) -> torch.Tensor:
    _check_shrink(x, a, rows, seg_starts, seg_lens, seg_slots, max_len)
    h = torch.zeros((x.shape[0], 16 * a.shape[1]), dtype=x.dtype, device=x.device)
    for start, n, slot in zip(seg_starts.tolist(), seg_lens.tolist(), seg_slots.tolist(), strict=True):
        idx = rows[start:start + n].long()
        h[idx] = x[idx] @ unpack_kpairs(a[slot]).t()
    return h


def pack_kpairs(m: torch.Tensor) -> torch.Tensor:
    """A matrix (rows, cols), cols even, as K-pair blocks (ceil(rows/16), cols/2, 16, 2), rows past the end zero."""
    rows, cols = m.shape
    nb = -(-rows // 16)
    padded = torch.zeros((nb * 16, cols), dtype=m.dtype, device=m.device)
    padded[:rows] = m
    return padded.view(nb, 16, cols // 2, 2).permute(0, 2, 1, 3).contiguous()


def unpack_kpairs(t: torch.Tensor) -> torch.Tensor:
    """The (16 blocks, cols) matrix of K-pair blocks t (blocks, cols/2, 16, 2) (a copy)."""
    nb, half = t.shape[0], t.shape[1]
    return t.permute(0, 2, 1, 3).reshape(nb * 16, 2 * half)


def expand_weights(b: torch.Tensor, slot: int, col0: int, col1: int) -> torch.Tensor:
    """Slot `slot`'s expand matrix B (R, col1 - col0) from b (S, NB, R/2, 16, 2) (a copy)."""
    return unpack_kpairs(b[slot])[col0:col1].t()


def _check_expand(y, h, b, scales, rows, seg_starts, seg_lens, seg_slots, max_len, col0, col1, rank_offset):
    check_tensor("y", y, 2, FLOAT_DTYPES)
    check_tensor("h", h, 2, FLOAT_DTYPES)
    check_tensor("b", b, 5, FLOAT_DTYPES)
    check_tensor("scales", scales, 1, (torch.float32,))
    expect(h.dtype == y.dtype and b.dtype == y.dtype, f"h and b must have y's dtype {y.dtype}")
    expect(b.shape[3:] == (16, 2), f"b must be (S, N/16, R/2, 16, 2) (see pack_expand), got {tuple(b.shape)}")
    expect(h.shape[0] == y.shape[0], f"h has {h.shape[0]} rows but y has {y.shape[0]}")
    expect(0 <= col0 <= col1 <= y.shape[1] and 16 * b.shape[1] >= col1,
           f"columns [{col0}, {col1}) must lie in y's {y.shape[1]} and b's {16 * b.shape[1]}")
    expect(0 <= rank_offset and rank_offset + 2 * b.shape[2] <= h.shape[1],
           f"ranks [{rank_offset}, {rank_offset + 2 * b.shape[2]}) must lie in h's {h.shape[1]} columns")
    expect(scales.shape[0] == b.shape[0], f"scales has {scales.shape[0]} entries for {b.shape[0]} slots")
    expect(y.stride(1) == 1 and h.stride(1) == 1 and b.is_contiguous(),
           "y and h need unit stride along their columns and b must be contiguous")
    _check_segments(rows, seg_starts, seg_lens, seg_slots, max_len)
    check_same_device(y=y, h=h, b=b, scales=scales, rows=rows, seg_starts=seg_starts)


def lora_expand_(y: torch.Tensor, h: torch.Tensor, b: torch.Tensor, scales: torch.Tensor, rows: torch.Tensor,
                 seg_starts: torch.Tensor, seg_lens: torch.Tensor, seg_slots: torch.Tensor, max_len: int,
                 col0: int, col1: int, rank_offset: int) -> None:
    """In place: for every row r of segment i (slot s = seg_slots[i]),
    y[r, col0:col1] += (h[r, rank_offset : rank_offset + R] @ B_s[:, col0:col1]) * scales[s], with b
    (S, NB, R/2, 16, 2) contiguous (B_s: expand_weights(b, s, ...)) and h, b in y's dtype; scales (S,) float32."""
    _check_expand(y, h, b, scales, rows, seg_starts, seg_lens, seg_slots, max_len, col0, col1, rank_offset)
    require_triton("lora_expand_", "lora_expand_ref_")
    from ._lora_triton import launch_expand

    launch_expand(y, h, b, scales, rows, seg_starts, seg_lens, seg_slots, max_len, col0, col1, rank_offset)


def lora_expand_ref_(y: torch.Tensor, h: torch.Tensor, b: torch.Tensor, scales: torch.Tensor, rows: torch.Tensor,
                     seg_starts: torch.Tensor, seg_lens: torch.Tensor, seg_slots: torch.Tensor, max_len: int,
                     col0: int, col1: int, rank_offset: int) -> None:
    _check_expand(y, h, b, scales, rows, seg_starts, seg_lens, seg_slots, max_len, col0, col1, rank_offset)
    r = 2 * b.shape[2]
    for start, n, slot in zip(seg_starts.tolist(), seg_lens.tolist(), seg_slots.tolist(), strict=True):
        idx = rows[start:start + n].long()
        d = h[idx, rank_offset:rank_offset + r] @ expand_weights(b, slot, col0, col1)
        y[idx, col0:col1] += d * scales[slot].item()
