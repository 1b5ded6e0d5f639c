"""Float weights (no quantization): which method a layer gets on each device.

On the CPU a bf16 layer holds only the K-pair layout of its C kernels (CpuPackedLinear with no format) wherever
the build multiplies it fast (`has_fast_bf16_linear`): on AVX512-BF16 the fused decode step streams it, prefill
runs the C blocked GEMM over it (on a CPU with AMX: from AMX_MIN_ROWS rows the AMX tile GEMM reading it in place,
or where that is missing, from ONEDNN_MIN_ROWS rows oneDNN's tile GEMM over a copy of it made for the call); on
AVX2 builds the float32-math kernels of csrc/cpu_linear_bf16_avx2.h read it (bf16 widened in registers); a tied
embedding gathers rows from it. Elsewhere on the CPU (float32 weights, or a build without either) the weight is
replaced by oneDNN's packed copy of it; a tied LM head keeps its dense weight there (the embedding reads rows of
it, which oneDNN's layout does not give).
TorchOps and TritonOps apply the dense weight as loaded (F.linear); TritonOps in the deterministic mode through
the fixed-tile Triton matmul instead (FIXED_DENSE), whose rows do not follow the row count as cuBLAS's do.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from radixgen.runtime.layers.linear import DENSE, DenseLinear, LinearMethod, pack_weight, packed_linear
from radixgen.runtime.layers.quantization.base import CpuPackedLinear


class OneDnnLinear(LinearMethod):
    """On the CPU, the weight replaced by its oneDNN-packed copy (see pack_weight); the dense weight stays where
    packing does not apply."""

    name = "onednn-packed"

    def process_weights(self, layer):
        packed = pack_weight(layer.weight)
        if packed is not None:
            layer.packed, layer.weight = packed, None

    def apply(self, layer, x):
        if layer.packed is None:
            return F.linear(x, layer.weight, layer.bias)
        return packed_linear(x, layer.packed, layer.bias)

    def dequantize(self, layer):
        return (layer.weight if layer.packed is None else layer.packed.to_dense()).float()

    def nbytes(self, layer):
        own = super().nbytes(layer)
        return own if layer.packed is None else own + layer.packed.numel() * layer.packed.element_size()


ONEDNN = OneDnnLinear()


class FixedDenseLinear(DenseLinear):
    """The weight as loaded, through radixgen.kernels.batch_invariant.fixed_matmul (the deterministic mode on
    CUDA): one tile shape and one pass over K whatever the row count."""

    name = "dense (fixed tiles)"

    def apply(self, layer, x):
        from radixgen.kernels.batch_invariant import fixed_matmul

        y = fixed_matmul(x.reshape(-1, layer.in_features), layer.weight, layer.bias)
        return y.view(*x.shape[:-1], layer.out_features)


FIXED_DENSE = FixedDenseLinear()


def method(ops: str, layer, kl) -> LinearMethod:
    """The float-weight method of `layer` under the ops set named `ops` (kl: its C kernels, or None)."""
    if ops != "cpu":
        return DENSE
    if kl is not None and kl.has_fast_bf16_linear and layer.dtype == torch.bfloat16 and layer.in_features % 2 == 0:
        return CpuPackedLinear(kl, None)  # (K pairs: an even input size, which a tensor-parallel share may lack)
    return DENSE if getattr(layer, "tied", False) else ONEDNN
