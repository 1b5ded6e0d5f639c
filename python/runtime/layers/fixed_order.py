"""The deterministic mode's tensor-parallel sums: tp 1 and tp 2 give the same bits (runtime/deterministic.py).

A row-parallel matmul (o_proj, down_proj) is a sum over its input features. With the default kernels tp 1 rounds
one float32 sum to bf16, while each rank of tp 2 rounds its partial sum to bf16 and the all-reduce adds those, so
the two round apart. In the deterministic mode every row-parallel matmul sums tp 2's cut of its input features
(the layer's `shares(2, r)`) as two fixed segments, each its own float32 accumulator, added in segment order and
rounded once:

- tp 1: one matmul whose weight carries the cut (`PackedWeight.fix_order(k_split=...)`: the C tile keeps the two
  accumulators apart and adds them before rounding);
- tp 2: each rank's matmul writes its segment's unrounded float32 partial sums (`fix_order(partial=True)`),
  every rank gathers them all (rank order is segment order) and adds them with the same instructions
  (`cpu_linear.sum_partials`), so every rank holds the bits tp 1 computes.

The column-parallel matmuls need nothing: each output is one accumulator over all input pairs, whatever rows a rank
holds. The vocabulary-parallel embedding sums one rank's row with -0.0 from the others, which is exact, and the LM
head's pieces are gathered, not summed. The supported sizes are those whose cut is a union of tp 2's segments: 1
and 2 (`SUPPORTED_TP`). A model that tp 2 cannot split at all keeps one sum at tp 1 (there is no tp 2 to match).
"""

from __future__ import annotations

import torch
from torch import nn

from radixgen.kernels import cpu_linear
from radixgen.runtime.layers.linear import LinearBase, RowParallelLinear
from radixgen.runtime.layers.quantization.base import CpuPackedLinear
from radixgen.runtime.parallel_context import ParallelAxis

SEGMENTS = 2  # the fixed segments of every row-parallel sum: tp 2's cut
SUPPORTED_TP = (1, 2)


class OrderedSum:
    """tp > 1: a row-parallel layer's (or the fused step's) float32 partial sums, gathered from every rank in rank
    order and added in that order into bf16, the same on every rank."""

    def __init__(self, kl, tp: ParallelAxis) -> None:
        self.kl, self.tp = kl, tp

    def __call__(self, partials: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """(M, N) float32 partial sums of this rank -> (M, N) bf16 (into `out` when given)."""
        parts = self.tp.all_gather(partials.contiguous(), dim=0)  # (S M, N): rank r's rows at [r M, (r + 1) M)
        return cpu_linear.sum_partials(self.kl, parts.view(self.tp.size, *partials.shape), None, out)

    def linear(self, layer: RowParallelLinear, x: torch.Tensor) -> torch.Tensor:
        """The layer's output for x (..., in_features): its partial sums, then the ordered sum."""
        x2 = x.reshape(-1, layer.in_features).contiguous()
        part = cpu_linear._linear(self.kl, layer.packed, x2, None, float_out=True)  # unrounded: a partial weight
        return self(part).view(*x.shape[:-1], layer.out_features)


def install(model: nn.Module, kl) -> None:
    """After the ops set's install, before the fused step is built (it copies the weights' descriptors): every
    row-parallel layer of `model` sums in the fixed segments. ValueError naming a layer that cannot: one not on
    the C bf16 matmuls (another layout's blocking follows the row count), a bias at tp > 1, a cut the layer does
    not describe."""
    for name, m in model.named_modules():
        if not isinstance(m, LinearBase):
            continue
        if not (isinstance(m.method, CpuPackedLinear) and m.method.fmt is None and m.packed is not None):
            raise ValueError(f"deterministic mode needs every linear layer on the C bf16 matmuls; {name} runs "
                             f"{m.method.name} (an odd input size, or a format without them)")
        # oneDNN's blocking follows the row count, and the AMX GEMM sums in its own order: every row count on the C
        # matmuls (whose fixed tiles the row-parallel layers get below)
        m.method.onednn_rows = m.method.amx_rows = 0
        if isinstance(m, RowParallelLinear):
            _fix(name, m, kl)


def _fix(name: str, layer: RowParallelLinear, kl) -> None:
    tp = layer.tp
    if tp.size not in SUPPORTED_TP:
        raise ValueError(f"deterministic mode does not run with tp_size={tp.size}: its fixed segments are tp 2's "
                         f"cut of each row-parallel matmul; use tp_size 1 or 2")
    if tp.size == 1:
        cut = segment_cut(name, layer)
        if cut is not None:
            layer.packed.fix_order(k_split=cut)
        return
    if layer.bias is not None:
        raise ValueError(f"deterministic mode does not run {name} at tp_size={tp.size}: a row-parallel layer with a "
                         f"bias (rank 0 alone holds it, and every rank must add it)")
    layer.packed.fix_order(partial=True)
    layer.ordered_sum = OrderedSum(kl, tp)


def segment_cut(name: str, layer: RowParallelLinear) -> int | None:
    """Where tp 2 cuts the layer's input features (an even column, the start of rank 1's share); None where tp 2
    cannot split the model."""
    if layer.shares is None:
        raise ValueError(f"deterministic mode: {name} was built with an input range but no `shares`, so its "
                         f"tensor-parallel cut is unknown")
    try:
        (s0, n0), (s1, n1) = (layer.shares(SEGMENTS, r) for r in range(SEGMENTS))
    except ValueError:
        return None
    if (s0, s0 + n0, s1 + n1) != (0, s1, layer.full_in) or n0 == 0 or n1 == 0:
        raise ValueError(f"deterministic mode: {name}'s tp 2 shares {(s0, n0)}, {(s1, n1)} do not cut its "
                         f"{layer.full_in} input features in two")
    if s1 % 2:
        raise ValueError(f"deterministic mode: {name}'s tp 2 cut at input feature {s1} is odd (the bf16 matmuls "
                         f"sum input pairs)")
    return s1
