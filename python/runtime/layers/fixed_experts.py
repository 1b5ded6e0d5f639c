"""The deterministic mode's expert blocks (runtime/deterministic.py): every expert's matmuls, and the router's, on C
kernels whose bits for a row do not depend on the rows beside it, on every CPU build and expert format.

An expert sees however many rows the batch routed to it, so each expert's matmul must give a row the same bits at
any row count:

- bf16 experts on AVX512-BF16 builds stay on the grouped C expert forward (cpu_moe: vdpbf16ps K pairs, a token's k
  terms added in its own order) and the fused decode step;
- bf16 experts elsewhere (AVX2, AVX-512 without BF16), where they would run torch's F.linear (blocking by the row
  count), are packed as bf16 K pairs and run one expert at a time on the per-linear C matmul (float32 FMA chains on
  AVX2: one chain per output, fed the input pairs in order);
- float32 experts run one expert at a time on the fixed float32 chains (kernels/cpu_fixed_f32.py);
- int8 / int4 experts (and a GGUF file's Q4_0 / Q4_1 / Q8_0 / Q6_K stacks decoded to those layouts) run one expert at
  a time on the per-linear C matmul in calls of at most STREAM_ROWS rows, where it streams the weight through the
  same tiles at every row count (past it another kernel runs); the fused decode step does not take them;
- GGUF stacks run per expert from their blocks (quantization/gguf_experts.py) already one expert at a time, each
  input row quantized on its own; calls of at most 8 rows where a part is a 32-value kind of cpu_gguf (its panel
  GEMM starts at 9 rows).

The combine is layers/moe.experts_forward's torch body for all but the first case: each (token, j) term weighted in
float32 and a token's k terms added in rank order j = 0..k-1, whatever other tokens share its experts. The router
(and Qwen2-MoE's shared-expert gate) is a matmul too: `fix_router` puts it on the bf16 K pairs (or the float32
chains) instead of torch's F.linear.
"""

from __future__ import annotations

import torch

from radixgen.kernels import cpu_fixed_f32, cpu_linear
from radixgen.kernels.cpu_gguf import BLOCK_VALUES, PANEL_GEMM_ROWS, KQuantWeight
from radixgen.runtime.layers.quantization.experts import (
    CpuGroupedLinear,
    DenseGroupedLinear,
    GroupedLinear,
    GroupedLinearMethod,
    _groups,
)
from radixgen.runtime.layers.quantization.gguf_experts import GGUFBlocksGroupedLinear

STREAM_ROWS = 16  # the rows up to which the int8 / int4 matmuls stream their weights (layers/fixed_order.py)


class PerExpertRows(GroupedLinearMethod):
    """Another method's experts applied one expert at a time, each expert's rows in calls of at most `rows` (None:
    all of them in one call): the inner method never sees two experts' rows, nor more rows than its kernel keeps on
    one path. Not a CpuGroupedLinear, so neither the grouped C forward nor the fused decode step takes it."""

    def __init__(self, inner: GroupedLinearMethod, rows: int | None) -> None:
        self.inner, self.rows = inner, rows
        self.name = f"{inner.name}, per expert" + ("" if rows is None else f", {rows} rows a call")

    def apply(self, layer, x, counts):
        pieces = []
        for e, s, t in _groups(x, counts):
            step = self.rows or t - s
            for a in range(s, t, step):
                b = min(a + step, t)
                one = [0] * len(counts)
                one[e] = b - a
                pieces.append(self.inner.apply(layer, x[a:b], one))
        return torch.cat(pieces) if pieces else x.new_empty((0, layer.out_features))

    def dequantize(self, layer, expert):
        return self.inner.dequantize(layer, expert)

    def nbytes(self, layer):
        return self.inner.nbytes(layer)


class FixedFloat32Experts(GroupedLinearMethod):
    """float32 experts, each in the fixed float32 matmul's layout (`layer.fixed_f32[e]`): one FMA chain per output in
    input order, the same bits at any row count and on every build."""

    name = "float32 fixed chains (per expert, C)"

    def __init__(self, kl) -> None:
        self.kl = kl

    def process_weights(self, layer):
        layer.fixed_f32 = [cpu_fixed_f32.pack(layer.weight[e].detach().float().contiguous())
                           for e in range(layer.num_experts)]
        layer.weight = None

    def apply(self, layer, x, counts):
        out = x.new_empty((x.shape[0], layer.out_features))
        for e, s, t in _groups(x, counts):
            out[s:t] = cpu_fixed_f32.linear(self.kl, layer.fixed_f32[e], layer.out_features, x[s:t].contiguous(), None)
        return out

    def dequantize(self, layer, expert):
        return cpu_fixed_f32.unpack(layer.fixed_f32[expert], layer.out_features)

    def nbytes(self, layer):
        return sum(p.numel() * 4 for p in layer.fixed_f32) + super().nbytes(layer)


def fix_experts(name: str, layer: GroupedLinear, kl, tp_size: int) -> None:
    """Put `layer`'s experts on a method whose rows keep their bits at any row count (above), or ValueError naming
    the layer: another method (the torch references of a format the C kernels do not take, an odd input size), or
    tp > 1 (the ranks' partial sums are all-reduced in no fixed order; ep: deterministic.check_config)."""
    if tp_size > 1:
        raise ValueError(f"deterministic mode does not run expert blocks at tp_size={tp_size}: the ranks' partial "
                         f"sums of {name} are all-reduced in no fixed order; use tp_size=1")
    m = layer.method
    if isinstance(m, CpuGroupedLinear) and m.fmt is None:
        if kl.has_decode_step:
            return  # the grouped bf16 K-pair tiles (cpu_moe)
        layer.method = PerExpertRows(m, None)  # (packed on another build: the per-linear kernels take the layout)
    elif isinstance(m, CpuGroupedLinear):
        layer.method = PerExpertRows(m, STREAM_ROWS)
    elif isinstance(m, GGUFBlocksGroupedLinear):
        panel = any(isinstance(w, KQuantWeight) and BLOCK_VALUES[w.type_name] == 32
                    for ws in layer.gguf_experts for w in ws)
        layer.method = PerExpertRows(m, PANEL_GEMM_ROWS - 1 if panel else None)
    elif type(m) is DenseGroupedLinear and layer.weight is not None and layer.weight.dtype == torch.float32:
        fixed = FixedFloat32Experts(kl)
        fixed.process_weights(layer)
        layer.method = fixed
    elif type(m) is DenseGroupedLinear and layer.weight is not None and layer.weight.dtype == torch.bfloat16 \
            and layer.in_features % 2 == 0:
        packed = CpuGroupedLinear(kl, None)
        packed.process_weights(layer)  # bf16 K pairs, which every build's per-linear kernels read
        layer.method = PerExpertRows(packed, None)
    else:
        raise ValueError(f"deterministic mode does not run the experts of {name} as {m.name}: an expert sees however "
                         f"many rows the batch routed to it, and this method's matmuls are not radixgen's C kernels "
                         f"(bf16 K pairs with an even input size, float32 chains, int8 / int4 layouts, GGUF blocks) "
                         f"whose rows keep their bits at any row count")


class FixedRouter:
    """A router's (E, H) weight on a C matmul whose rows keep their bits at any row count: bf16 K pairs (bf16
    weights, even H) or the fixed float32 chains (float32); `__call__(x)` is F.linear(x, weight, bias) in x's
    dtype."""

    def __init__(self, kl, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        self.kl, self.n = kl, weight.shape[0]
        self.f32 = weight.dtype == torch.float32
        self.packed = cpu_fixed_f32.pack(weight.contiguous()) if self.f32 else cpu_linear.pack_bf16(weight)
        self.bias = None if bias is None else bias.detach().to(weight.dtype).contiguous()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        x2 = x.reshape(-1, x.shape[-1]).contiguous()
        y = cpu_fixed_f32.linear(self.kl, self.packed, self.n, x2, self.bias) if self.f32 else \
            cpu_linear._linear(self.kl, self.packed, x2, self.bias)
        return y.view(*x.shape[:-1], self.n)


def fix_router(name: str, module, kl) -> None:
    """A router module (one with a `fixed_matmul` slot: models/moe_block.Router, gpt-oss's with its bias) onto
    FixedRouter, or ValueError naming it."""
    w = module.weight.detach()
    if w.dtype == torch.float32 or (w.dtype == torch.bfloat16 and w.shape[1] % 2 == 0):
        module.fixed_matmul = FixedRouter(kl, w, getattr(module, "bias", None))
        return
    raise ValueError(f"deterministic mode does not run the router {name}: {w.dtype} weights of {w.shape[1]} input "
                     f"features have no C matmul whose rows keep their bits (bf16 with an even size, or float32)")
