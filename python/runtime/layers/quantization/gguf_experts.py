"""An expert block's GGUF stacks run from their own blocks, one expert at a time, on the per-linear C kernels: the
kinds the grouped C layouts (cpu_moe) do not hold as they are. MXFP4 (gpt-oss), Q5_0, Q5_1, Q2_K, Q3_K, IQ4_NL and
IQ4_XS stay the file's bytes (views of the memory-mapped file, kernels/cpu_gguf_more.py); Q4_K and Q5_K take the
K-quant layout (kernels/cpu_gguf.py: 4 bytes more per 256 values), a Q6_K part beside them its 6.56 bits as
stored. So an expert block costs about its file bytes, where decoding to int8 took 1.9x (MXFP4) and dequantizing
to bf16 3.8x (Q4_K).

apply: the rows routed to expert e (grouped by expert, experts in order 0..E-1) go through one C matmul per part
of expert e (gate rows, then up rows), outputs side by side. A row's result does not depend on the other rows of
the call: the kernels quantize each input row to int8 on its own and sum each output in one fixed order.
"""

from __future__ import annotations

import torch

from radixgen.kernels import cpu_gguf, cpu_gguf_more
from radixgen.runtime.layers.quantization.experts import GroupedLinearMethod, _groups

# the kinds the grouped C layouts take from their exact values (gguf.NATIVE): a stack of one of them stays there (the
# fused decode step reads those layouts); every other kind with a per-linear kernel runs here, as do mixed stacks
GROUPED_NATIVE = ("Q4_0", "Q4_1", "Q8_0", "Q6_K")


def _has_kernel(part) -> bool:
    """Whether a part (a gguf.GGUFTensor) has a per-linear C kernel reading its blocks: whole blocks per row."""
    if part.type_name in cpu_gguf_more.KINDS:
        return part.columns % cpu_gguf_more.QK[part.type_name] == 0
    return part.type_name in cpu_gguf.KINDS and part.columns % cpu_gguf.BLOCK_VALUES[part.type_name] == 0


def takes(experts: list[list], kl) -> bool:
    """Whether an expert block's parts (per expert, in row order) run here: C kernels, parts the grouped layouts do
    not hold as one kind (a kind of their own, or gate and up of two kinds), and a per-linear kernel for each."""
    parts = [p for ps in experts for p in ps]
    kinds = {p.type_name for p in parts}
    grouped = len(kinds) == 1 and kinds <= set(GROUPED_NATIVE)
    return kl is not None and not grouped and all(map(_has_kernel, parts))


def _weight(part):
    if part.type_name in cpu_gguf_more.KINDS:
        return cpu_gguf_more.wrap(part.raw, part.type_name, part.columns)  # a view of the file's blocks
    return cpu_gguf.repack(part.raw.contiguous(), part.type_name, part.columns)


class GGUFBlocksGroupedLinear(GroupedLinearMethod):
    """Each expert's parts as C block weights (`layer.gguf_experts[e]`: one per part, rows in order)."""

    def __init__(self, kl, experts: list[list]) -> None:
        self.kl, self.experts = kl, experts  # the GGUFTensors until process_weights
        kinds = "/".join(sorted({p.type_name for ps in experts for p in ps}))
        self.name = f"gguf {kinds} (per expert, C)"

    def process_weights(self, layer):
        layer.gguf_experts = [[_weight(p) for p in parts] for parts in self.experts]
        self.experts = None

    def apply(self, layer, x, counts):
        out = torch.empty((x.shape[0], layer.out_features), dtype=x.dtype)
        xf = x.float().contiguous()  # the kernels read float32 rows
        for e, s, t in _groups(x, counts):
            col = 0
            for w in layer.gguf_experts[e]:
                out[s:t, col:col + w.n] = cpu_gguf._linear(self.kl, w, xf[s:t])
                col += w.n
        return out

    def dequantize(self, layer, expert):
        ws = layer.gguf_experts[expert]
        return torch.cat([cpu_gguf._rows(self.kl, w, torch.arange(w.n), torch.float32) for w in ws])

    def nbytes(self, layer):
        return sum(w.nbytes for ws in layer.gguf_experts for w in ws) + super().nbytes(layer)
