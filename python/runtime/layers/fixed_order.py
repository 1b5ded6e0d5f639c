"""The deterministic mode's tensor-parallel sums: tp 1 and tp 2 give the same bits, and every tp size the same bits
whatever the batch (runtime/deterministic.py).

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
holds. The fixed segments need the fixed bf16 tiles of an AVX512-BF16 build; elsewhere (AVX2, AVX-512 without BF16)
tp 1 sums each row-parallel matmul as one accumulator and larger groups are refused.

The matmuls of other weight formats: the bf16 K pairs and the GGUF K-quant kernels give a row the same bits at any
row count on every build (tests/kernels/test_deterministic_kernels.py); the int8 / int4 ones (int8, int4, AWQ,
GPTQ, GGUF Q4_0 / Q4_1 / Q8_0) stream up to 16 rows and run another kernel beyond. `FixedRows` keeps every row of
theirs on the streaming kernel: calls of at most 16 rows (8 for the GGUF 32-value kinds' panel GEMM). Its
`even_rows` (an odd call's last row twice) is no longer needed: the int4 streaming tiles of AVX512-BF16 builds sum
every row as their former one-row path did (two chains a quad), so a lone row has the bits it has beside others.

The vocabulary-parallel embedding sums one rank's row with -0.0 from the others, which is exact, and the LM head's
pieces are gathered, not summed. A model that tp 2 cannot split at all keeps one sum at tp 1 (there is no tp 2 to
match).

Larger groups (tp 3, 4, ...) sum their own cut: each rank's share one segment (`fix_order(partial=True)`), the
segments gathered and added in rank order, as at tp 2. A row's bits then depend on the tp size (a rank's share of
tp 4 is half a segment of tp 2's, summed as its own accumulator) but never on the batch: the promise the mode makes
at every size is that of one layout, and tp 1 == tp 2 is the one cross-layout equality it adds. Matching tp 1 at
tp 4 would take tp 4's four segments at tp 1 and 2 as well (a k_split per segment), which the C tiles do not have.
"""

from __future__ import annotations

import torch
from torch import nn

from radixgen.kernels import cpu_fixed_f32, cpu_linear
from radixgen.kernels.cpu_gguf import BLOCK_VALUES, PANEL_GEMM_ROWS, KQuantWeight
from radixgen.runtime.ground.parallel_context import ParallelAxis
from radixgen.runtime.layers.fixed_experts import STREAM_ROWS, fix_experts, fix_router
from radixgen.runtime.layers.linear import DenseLinear, LinearBase, LinearMethod, RowParallelLinear
from radixgen.runtime.layers.quantization.base import CpuPackedLinear
from radixgen.runtime.layers.quantization.experts import GroupedLinear
from radixgen.runtime.layers.quantization.fp8 import FP8Linear
from radixgen.runtime.layers.quantization.gguf_k import GGUFPartsLinear
from radixgen.runtime.layers.quantization.unquantized import OneDnnLinear

SEGMENTS = 2  # the fixed segments of every row-parallel sum at tp 1 and 2: tp 2's cut


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


class FixedRows(LinearMethod):
    """An int8 / int4 layer's method (or a GGUF layer's with such parts) with every row on the streaming kernel:
    x cut into calls of at most STREAM_ROWS rows, and where `even_rows`, each call given an even number of rows (an
    odd one's last row twice). Its packed weight (int8 / int4 layouts) goes to the fused decode step, which streams
    every row count through the same tiles as these calls (linear_team_bf16, never the blocked GEMM): a row gets
    the same bits there at any batch."""

    def __init__(self, inner: LinearMethod, even_rows: bool, rows: int = STREAM_ROWS) -> None:
        self.inner, self.even, self.rows = inner, even_rows, rows
        self.name = f"{inner.name}, fixed rows"

    def _call(self, layer, x2: torch.Tensor) -> torch.Tensor:
        m = x2.shape[0]
        if self.even and m % 2:
            return self.inner.apply(layer, torch.cat([x2, x2[-1:]]))[:m]
        return self.inner.apply(layer, x2)

    def apply(self, layer, x):
        x2 = x.reshape(-1, layer.in_features)
        m = x2.shape[0]
        if m <= self.rows:
            y = self._call(layer, x2)
        else:
            y = torch.cat([self._call(layer, x2[a:a + self.rows]) for a in range(0, m, self.rows)])
        return y.view(*x.shape[:-1], layer.out_features)

    def dequantize(self, layer):
        return self.inner.dequantize(layer)

    def embed(self, layer, ids):
        return self.inner.embed(layer, ids)

    def nbytes(self, layer):
        return self.inner.nbytes(layer)

    def packed_weight(self, layer):
        return self.inner.packed_weight(layer)


class FixedFloat32(LinearMethod):
    """A float32 layer's method in the mode (dtype float32): the weight in the layout of the fixed float32 matmul
    (kernels/cpu_fixed_f32.py), one fused multiply-add chain per output in input order, whose bits follow neither the
    rows of the call nor the build. Replaces oneDNN's packed copy, whose blocking follows the row count."""

    name = "float32 fixed chains (C)"

    def __init__(self, kl) -> None:
        self.kl = kl

    def adopt(self, layer, w: torch.Tensor) -> None:
        layer.fixed_f32 = cpu_fixed_f32.pack(w)
        layer.weight, layer.packed, layer.method = None, None, self

    def apply(self, layer, x):
        x2 = x.reshape(-1, layer.in_features).contiguous()
        y = cpu_fixed_f32.linear(self.kl, layer.fixed_f32, layer.out_features, x2, layer.bias)
        return y.view(*x.shape[:-1], layer.out_features)

    def dequantize(self, layer):
        return cpu_fixed_f32.unpack(layer.fixed_f32, layer.out_features)

    def embed(self, layer, ids):
        flat = ids.reshape(-1).to(torch.int64)
        return cpu_fixed_f32.rows(layer.fixed_f32, flat).view(*ids.shape, layer.in_features)

    def nbytes(self, layer):
        return layer.fixed_f32.numel() * 4 + super().nbytes(layer)


def _int_matmuls(method: LinearMethod, layer) -> bool | None:
    """Whether the layer's C matmuls include ones that change path with the row count (True: int8 / int4, GGUF
    Q4_0 / Q4_1 / Q8_0 and the other block kinds), only bf16 K pairs / GGUF K-quants (False), or it is not on the C
    matmuls at all (None)."""
    if isinstance(method, CpuPackedLinear) and getattr(layer, "packed", None) is not None:
        return method.fmt is not None
    if isinstance(method, GGUFPartsLinear):
        return not all(isinstance(w, KQuantWeight) for w in layer.gguf_weights) or _panel_rows(layer) is not None
    return None


def _panel_rows(layer) -> int | None:
    """A GGUF layer with Q4_0 / Q4_1 / Q8_0 parts: the row count from which their kernel switches from the int8
    tiles to the panel GEMM (float32 inputs: other bits), which its calls must stay under; None for other layers."""
    kinds = [w for w in getattr(layer, "gguf_weights", ()) if isinstance(w, KQuantWeight)]
    return PANEL_GEMM_ROWS if any(BLOCK_VALUES[w.type_name] == 32 for w in kinds) else None


def install(model: nn.Module, kl) -> None:
    """After the ops set's install, before the fused step is built (it copies the weights' descriptors): every
    row-parallel layer of `model` sums in the fixed segments, every int8 / int4 layer keeps its rows on the
    streaming kernel. ValueError naming a layer that cannot: one not on the C matmuls (another layout's blocking
    follows the row count), a quantized or biased row-parallel layer at tp > 1, a cut the layer does not
    describe, tp > 1 on a build without the fixed tiles."""
    for name, m in model.named_modules():
        if isinstance(m, GroupedLinear):
            fix_experts(name, m, kl, model.parallel.tp.size if hasattr(model, "parallel") else 1)
            continue
        if hasattr(m, "fixed_matmul"):  # an expert block's router (torch's F.linear blocks by the row count)
            fix_router(name, m, kl)
            continue
        if not isinstance(m, LinearBase):
            continue
        if m.dtype == torch.float32 and _float32(name, m, kl):
            continue
        if type(m.method) is FP8Linear:
            _fp8_as_bf16(m, kl)
        quantized = _int_matmuls(m.method, m)
        if quantized is None:
            raise ValueError(f"deterministic mode needs every linear layer on radixgen's C matmuls (bf16 K pairs, "
                             f"int8 / int4, GGUF K-quants); {name} runs {m.method.name} (an odd input size, or a "
                             f"format without them)")
        if isinstance(m.method, CpuPackedLinear):
            # oneDNN's blocking follows the row count, and the AMX GEMM sums in its own order: every row count on the
            # C matmuls (whose fixed tiles the row-parallel layers get below)
            m.method.onednn_rows = m.method.amx_rows = 0
        if isinstance(m, RowParallelLinear):
            _fix(name, m, kl, quantized)
        if quantized:
            panel = _panel_rows(m)
            m.method = FixedRows(m.method, even_rows=False,
                                 rows=STREAM_ROWS if panel is None else min(STREAM_ROWS, panel - 1))


def _float32(name: str, layer, kl) -> bool:
    """float32 activations: a float weight (oneDNN's packed copy, or the dense weight of a tied LM head) onto the
    fixed float32 chains (True); other formats go on as in bf16 models (False: their C matmuls take float32 rows,
    FixedRows keeping the int8 / int4 ones on one path). A row-parallel float layer at tp 1 only: the chains have
    no fixed segments to match across ranks."""
    if isinstance(layer.method, OneDnnLinear):
        w = layer.method.dequantize(layer)
    elif type(layer.method) is DenseLinear and layer.weight is not None:
        w = layer.weight.detach()
    else:
        return False
    if isinstance(layer, RowParallelLinear) and layer.tp.size > 1:
        raise ValueError(f"deterministic mode does not run {name} at tp_size={layer.tp.size} in float32: the ranks' "
                         f"partial sums have no fixed segments there; use dtype='bfloat16' or tp_size 1")
    FixedFloat32(kl).adopt(layer, w.float().contiguous())
    return True


def _fp8_as_bf16(layer, kl) -> None:
    """An fp8 layer's weight as bf16 K pairs on the C matmuls. e4m3 values are exact in bf16, but the upcast path
    (FP8Linear) multiplies them by their float32 scale and rounds the product to the activations' dtype for torch's
    matmul: the weight rounded the same way here is the bf16 weight that path multiplies by, every row of it (the
    mode's results are those of the default path's weight; it holds 2 bytes a weight instead of 1). A layer whose
    input size is odd (no K pairs) or whose activations are not bf16 keeps the upcast path, which install refuses."""
    if layer.in_features % 2 or layer.dtype != torch.bfloat16 or not kl.has_fast_bf16_linear:
        return
    w = (layer.qweight.float() * layer.qscale[:, None]).to(torch.bfloat16)
    del layer.qweight, layer.qscale  # (buffers)
    layer.packed, layer.perm = cpu_linear.pack_bf16(w), None
    layer.method = CpuPackedLinear(kl, None)


def _fix(name: str, layer: RowParallelLinear, kl, quantized: bool) -> None:
    tp = layer.tp
    if tp.size > 1 and not kl.has_decode_step:
        raise ValueError(f"deterministic mode does not run with tp_size={tp.size} on the {kl.isa} build of the CPU "
                         f"kernels: the fixed segments of {name} need the AVX512-BF16 tiles; use tp_size 1")
    if tp.size > 1 and (quantized or not isinstance(layer.method, CpuPackedLinear)):
        raise ValueError(f"deterministic mode does not run {name} at tp_size={tp.size}: its {layer.method.name} "
                         f"weights have no fixed segments (only bf16 weights do); use tp_size 1")
    if tp.size == 1:
        cut = segment_cut(name, layer) if kl.has_decode_step and not quantized and \
            isinstance(layer.method, CpuPackedLinear) else None
        if cut is not None:
            layer.packed.fix_order(k_split=cut)
        return
    if layer.bias is not None:
        raise ValueError(f"deterministic mode does not run {name} at tp_size={tp.size}: a row-parallel layer with a "
                         f"bias (rank 0 alone holds it, and every rank must add it)")
    # each rank's share one segment; at tp 2 those are the segments tp 1 sums apart (the same bits), at a larger
    # size the group's own (the same bits whatever the batch, at that size)
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
