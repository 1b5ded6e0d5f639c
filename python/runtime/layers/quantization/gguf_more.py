"""GGUF layers holding Q5_0, Q5_1, Q2_K, Q3_K, IQ4_NL, IQ4_XS or MXFP4 tensors on the C kernels of
kernels/cpu_gguf_more.py, each part read as the file stores it (the blocks stay views of the memory-mapped file:
nothing is dequantized or copied at load). The layer's other parts keep their own kinds as in GGUFPartsLinear: a
Q4_K_M-like file's Q4_K / Q5_K on the K-quant kernels, Q4_0 / Q4_1 / Q8_0 / Q6_K in the int4 / int8 layouts."""

from __future__ import annotations

import logging

from radixgen.kernels import cpu_gguf_more
from radixgen.runtime.layers.quantization.gguf_k import GGUFPartsLinear, runs_alone

logger = logging.getLogger("radixgen.runtime.layers.quantization.gguf")


def own_kernel(part) -> bool:
    """Whether a part (a gguf.GGUFTensor) runs on these kernels: one of their types, whole blocks per row."""
    return part.type_name in cpu_gguf_more.KINDS and part.columns % cpu_gguf_more.QK[part.type_name] == 0


def takes(parts: list, in_features: int) -> bool:
    """Whether a layer goes here: a part of these kernels' types, and every part runs on a C kernel of its own."""
    return any(own_kernel(p) for p in parts) and all(own_kernel(p) or runs_alone(p, in_features) for p in parts)


class GGUFBlocksLinear(GGUFPartsLinear):
    """GGUFPartsLinear whose parts may also be BlockWeights (the file's blocks as stored)."""

    def process_weights(self, layer):
        mine = [(i, p) for i, p in enumerate(self.parts) if own_kernel(p)]
        others = [p for p in self.parts if not own_kernel(p)]
        self.parts = others
        super().process_weights(layer)  # the other parts, in order
        weights = iter(layer.gguf_weights)
        ours = {i: cpu_gguf_more.wrap(p.raw, p.type_name, p.columns) for i, p in mine}
        layer.gguf_weights = [ours[i] if i in ours else next(weights) for i in range(len(mine) + len(others))]

    def _one(self, w, x2):
        if isinstance(w, cpu_gguf_more.BlockWeight):
            return cpu_gguf_more._linear(self.kl, w, x2)
        return super()._one(w, x2)

    def _rows(self, w, ids, dtype):
        if isinstance(w, cpu_gguf_more.BlockWeight):
            return cpu_gguf_more._rows(self.kl, w, ids, dtype)
        return super()._rows(w, ids, dtype)
