"""AWQ checkpoints (AutoAWQ's GEMM layout): int4 values, a zero point and an fp16 scale per group of input
columns, w = scale * (q - zero).

Tensors per linear layer: qweight (in, out / 8) int32 and qzeros (in / group, out / 8) int32, eight 4-bit values
per int32 along the output dim, nibble i (bits 4i .. 4i + 3) holding output column 8c + AWQ_ORDER[i] of packed
column c (radixgen.kernels.quant_matmul: AWQ_ORDER, unpack_awq); scales (in / group, out) fp16. config.json's
quantization_config: quant_method "awq", bits 4, group_size, zero_point true, version "gemm". The LM head stays
unquantized. On the CPU the values are repacked into the int4 layout of the C kernels; on CUDA the Triton kernel
reads these tensors as they are."""

from __future__ import annotations

import torch

from radixgen.kernels.quant_matmul import unpack_awq
from radixgen.runtime.layers.linear import new_param
from radixgen.runtime.layers.quantization.base import (
    CheckpointLinear,
    CpuPackedLinear,
    Format,
    QuantizedWeight,
    TorchQuantizedLinear,
    split_note,
)


class AWQFormat(Format):
    name = "awq"

    def __init__(self, group_size: int) -> None:
        self.group_size = group_size  # 0: one group per output channel

    def group(self, layer) -> int:
        return self.group_size or layer.in_features

    def create_weights(self, layer):
        k, n, g = layer.in_features, layer.out_features, self.group(layer)
        if k % g or n % 8:
            raise ValueError(f"awq: a layer of {k} inputs and {n} outputs does not fit group size {g} and 8 outputs "
                             f"per int32{split_note(layer)}")
        layer.weight = None
        loader = layer.weight_loader
        grouped = 0 if self.group_size else None  # one group per channel: every rank holds the whole of it
        layer.qweight = new_param((k, n // 8), torch.int32, loader, output_dim=1, input_dim=0, output_pack=8)
        layer.qzeros = new_param((k // g, n // 8), torch.int32, loader, output_dim=1, input_dim=grouped,
                                 output_pack=8, input_pack=g)
        layer.scales = new_param((k // g, n), torch.float16, loader, output_dim=1, input_dim=grouped, input_pack=g)

    def quantized(self, layer):
        q = unpack_awq(layer.qweight.data).t().contiguous()  # (out, in)
        zeros = unpack_awq(layer.qzeros.data).t().float().contiguous()
        return QuantizedWeight(4, q, layer.scales.data.t().float().contiguous(), self.group(layer), zeros, True)

    def drop(self, layer):
        layer.qweight = layer.qzeros = layer.scales = None


class TritonAWQLinear(CheckpointLinear):
    """CUDA: the checkpoint's tensors as loaded, through the Triton AWQ dequantizing matmul."""

    name = "awq (triton)"
    batch_invariant = False  # the deterministic mode: one row tile whatever the row count

    def apply(self, layer, x):
        from radixgen import kernels

        y = kernels.awq_matmul(x.reshape(-1, layer.in_features), layer.qweight, layer.qzeros, layer.scales,
                               self.fmt.group(layer), layer.bias, batch_invariant=self.batch_invariant)
        return y.view(*x.shape[:-1], layer.out_features)


def method(ops: str, spec, layer, kl):
    fmt = AWQFormat(spec.group_size)
    if ops == "cpu" and kl is not None:
        return CpuPackedLinear(kl, fmt)
    if ops == "triton":
        return TritonAWQLinear(fmt)
    return TorchQuantizedLinear(fmt)
