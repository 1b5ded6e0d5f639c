"""The segmented LoRA deltas of the CPU path (csrc/cpu_lora.h, AVX512-BF16): the checked wrapper and its
unchecked call (the ops set's LoRA layers call the latter once per projection)."""

from __future__ import annotations

import torch

from ._checks import check_contiguous, check_tensor, expect
from .cpu import CKernels, _check_cpu, _require


def lora_delta_(y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scales: torch.Tensor,
                ranks: torch.Tensor, segments: list[tuple[int, int]], rows: torch.Tensor, seg_starts: torch.Tensor,
                seg_lens: torch.Tensor, seg_slots: torch.Tensor, *, kl: CKernels | None = None) -> None:
    """In place, bfloat16 (AVX512-BF16 CPUs): y (T, N) += the LoRA deltas of a merged projection whose input is
    x (T, K), both contiguous, for the rows of each segment (radixgen.kernels.lora's K-pair blocks: a (S,
    nseg R / 16, K/2, 16, 2), b (S, N/16, R/2, 16, 2), scales (S,) float32), one output segment [c0, c1) per
    shrink segment; ranks (S,) int32
    (any stride): slot s's rank r <= R, 0 for none. The same as lora_shrink_ref then lora_expand_ref_ per
    segment (with a slot's ranks past r zero)."""
    for name, t, dims in (("y", y, 2), ("x", x, 2), ("a", a, 5), ("b", b, 5)):
        check_tensor(name, t, dims, (torch.bfloat16,))
        check_contiguous(name, t)
    check_tensor("scales", scales, 1, (torch.float32,))
    check_tensor("ranks", ranks, 1, (torch.int32,))
    for name, t in (("rows", rows), ("seg_starts", seg_starts), ("seg_lens", seg_lens), ("seg_slots", seg_slots)):
        check_tensor(name, t, 1, (torch.int64,))
        check_contiguous(name, t)
    r, nseg = 2 * b.shape[2], len(segments)
    expect(x.shape[0] == y.shape[0] and a.shape == (b.shape[0], -(-nseg * r // 16), x.shape[1] // 2, 16, 2)
           and b.shape[1] == -(-y.shape[1] // 16) and b.shape[3:] == (16, 2),
           f"expected a (S, {nseg} R / 16, {x.shape[1] // 2}, 16, 2) and b (S, {-(-y.shape[1] // 16)}, R/2, 16, 2) "
           f"for x {tuple(x.shape)}, y {tuple(y.shape)} and {nseg} segments; "
           f"got a {tuple(a.shape)}, b {tuple(b.shape)}")
    expect(scales.shape[0] == ranks.shape[0] == b.shape[0], "scales and ranks need one entry per slot")
    expect([c for c, _ in segments] == [0] + [e for _, e in segments[:-1]] and segments[-1][1] == y.shape[1],
           f"segments must tile y's {y.shape[1]} columns in order, got {segments}")
    expect(seg_starts.shape == seg_lens.shape == seg_slots.shape, "seg_starts, seg_lens and seg_slots differ in length")
    expect(int(ranks.min()) >= 0 and int(ranks.max()) <= r, f"ranks must lie in [0, {r}]")
    _check_cpu(y=y, x=x, a=a, b=b, scales=scales, ranks=ranks, rows=rows)
    kl = _require(kl)
    expect(kl.has_decode_step, "the CPU LoRA kernel needs AVX512-BF16")
    seg_end = torch.tensor([e for _, e in segments], dtype=torch.int64)
    _lora_delta(kl, y, x, a, b, scales, ranks, seg_end, rows, seg_starts, seg_lens, seg_slots)


def _lora_delta(kl: CKernels, y, x, a, b, scales, ranks, seg_end, rows, seg_starts, seg_lens, seg_slots) -> None:
    h = torch.empty(rows.shape[0] * 16 * a.shape[1], dtype=torch.bfloat16)
    kl.fn("rg_lora_delta_bf16")(
        x=x.data_ptr(), K=x.shape[1], y=y.data_ptr(), N=y.shape[1], a=a.data_ptr(), b=b.data_ptr(),
        scales=scales.data_ptr(), ranks=ranks.data_ptr(), rank_stride=ranks.stride(0), R=2 * b.shape[2],
        seg_end=seg_end.data_ptr(), nseg=seg_end.shape[0], rows=rows.data_ptr(), start=seg_starts.data_ptr(),
        len=seg_lens.data_ptr(), slot=seg_slots.data_ptr(), n_groups=seg_starts.shape[0], h=h.data_ptr())
