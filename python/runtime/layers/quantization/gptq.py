"""GPTQ checkpoints (AutoGPTQ / GPTQModel): int4 values, a zero point and an fp16 scale per group of input columns,
w = scale * (q - zero), with g_idx naming each input column's group.

Tensors per linear layer: qweight (in / 8, out) int32, eight 4-bit values per int32 along the input dim (nibble
i of row r is input 8r + i); qzeros (in / group, out / 8) int32 along the output dim (nibble i of column c is
output 8c + i), holding zero - 1 in checkpoint format "gptq" (v1) and the zero itself in "gptq_v2"; scales
(in / group, out) fp16; g_idx (in,) int32, the group of each input column: in order (column // group) unless the
model was quantized in activation order (desc_act), where groups are scattered over the columns. On the CPU such
a layer's columns are reordered at load so that groups are contiguous, and its input is permuted alike at each
call (those layers stay out of the fused decode step); on CUDA the Triton kernel reads g_idx. The LM head stays
unquantized."""

from __future__ import annotations

import torch

from radixgen.kernels.quant_matmul import unpack_cols, unpack_rows
from radixgen.runtime.layers.linear import new_param
from radixgen.runtime.layers.quantization.base import (
    CheckpointLinear,
    CpuPackedLinear,
    Format,
    QuantizedWeight,
    TorchQuantizedLinear,
    split_note,
)


class GPTQFormat(Format):
    name = "gptq"

    def __init__(self, group_size: int, zero_offset: int) -> None:
        self.group_size, self.zero_offset = group_size, zero_offset  # group 0: per output channel

    def group(self, layer) -> int:
        return self.group_size or layer.in_features

    def create_weights(self, layer):
        k, n, g = layer.in_features, layer.out_features, self.group(layer)
        if k % g or k % 8 or n % 8:
            raise ValueError(f"gptq: a layer of {k} inputs and {n} outputs does not fit group size {g} and 8 values "
                             f"per int32{split_note(layer)}")
        layer.weight = None
        loader = layer.weight_loader
        grouped = 0 if self.group_size else None  # one group per channel: every rank holds the whole of it
        layer.qweight = new_param((k // 8, n), torch.int32, loader, output_dim=1, input_dim=0, input_pack=8)
        layer.qzeros = new_param((k // g, n // 8), torch.int32, loader, output_dim=1, input_dim=grouped,
                                 output_pack=8, input_pack=g)
        layer.scales = new_param((k // g, n), torch.float16, loader, output_dim=1, input_dim=grouped, input_pack=g)
        layer.g_idx = new_param((k,), torch.int32, loader, output_dim=None, input_dim=0)
        layer.g_idx.data.copy_(torch.arange(k) // g)  # checkpoints without desc_act may leave g_idx out
        layer.g_idx.optional = True

    def zeros(self, layer) -> torch.Tensor:
        """(in / group, out) float32 zero points."""
        return unpack_cols(layer.qzeros.data).float() + self.zero_offset

    def local_groups(self, layer) -> torch.Tensor:
        """g_idx as indices of the layer's own scales: a row-parallel rank holds the groups of its input columns.
        With activation order (desc_act) a rank's columns may belong to any group, which a split by input
        features cannot keep: an error naming the combination."""
        groups = layer.g_idx.data.long()
        if not self.group_size:
            return groups  # one group
        first = layer.in_part[0] // self.group_size
        if first:
            groups = groups - first
        n = layer.in_features // self.group_size
        if layer.tp.size > 1 and groups.numel() and (groups.min() < 0 or groups.max() >= n):
            raise ValueError(f"gptq: this layer's g_idx (activation order, desc_act) scatters groups over the input "
                             f"columns, which tensor parallelism (tp_size={layer.tp.size}) cannot split by "
                             f"input features; serve this checkpoint with tp_size 1, or use one quantized without "
                             f"desc_act")
        return groups

    def quantized(self, layer):
        k, g = layer.in_features, self.group(layer)
        q = unpack_rows(layer.qweight.data)  # (in, out)
        groups = self.local_groups(layer)
        perm = None
        if not torch.equal(groups, torch.arange(k) // g):
            perm = torch.argsort(groups, stable=True)
            if not torch.equal(groups[perm], torch.arange(k) // g):
                raise ValueError(f"gptq: g_idx must give each of the {k // g} groups {g} input columns")
            q = q[perm]
        return QuantizedWeight(4, q.t().contiguous(), layer.scales.data.t().float().contiguous(), g,
                               self.zeros(layer).t().contiguous(), True, perm)

    def drop(self, layer):
        layer.qweight = layer.qzeros = layer.scales = layer.g_idx = None


class TritonGPTQLinear(CheckpointLinear):
    """CUDA: the checkpoint's tensors as loaded, through the Triton GPTQ dequantizing matmul (g_idx included)."""

    name = "gptq (triton)"
    batch_invariant = False  # the deterministic mode: one row tile whatever the row count

    def process_weights(self, layer):
        layer.g_idx.data = self.fmt.local_groups(layer).int()

    def apply(self, layer, x):
        from radixgen import kernels

        y = kernels.gptq_matmul(x.reshape(-1, layer.in_features), layer.qweight, layer.qzeros, layer.scales,
                                layer.g_idx, self.fmt.zero_offset, layer.bias,
                                batch_invariant=self.batch_invariant)
        return y.view(*x.shape[:-1], layer.out_features)


def method(ops: str, spec, layer, kl):
    fmt = GPTQFormat(spec.group_size, spec.zero_offset)
    if ops == "cpu" and kl is not None:
        return CpuPackedLinear(kl, fmt)
    if ops == "triton":
        return TritonGPTQLinear(fmt)
    return TorchQuantizedLinear(fmt)
