"""LoRA as a layer around any linear method: the base method's output plus the step's adapter deltas.

The wrapper knows nothing of the base method's weight format (dense, oneDNN-packed, quantized...): it calls
`base.apply` and adds, through the ops set's `lora_delta_`, the deltas of the rows that have an adapter (the
forward context's `lora`, a lora.pool.LoRABatch; None when no row of the step has one). Weights are never
merged and the batch is never split.
"""

from __future__ import annotations

import torch
from torch import nn

from radixgen.runtime.ground.forward_context import get_forward_context
from radixgen.runtime.layers.linear import LinearMethod
from radixgen.runtime.lora.pool import GROUPS, LoRAPool


class LoRALinearMethod(LinearMethod):
    def __init__(self, base: LinearMethod, pool: LoRAPool, ops, layer_id: int, group: str) -> None:
        self.base, self.pool, self.ops, self.layer_id, self.group = base, pool, ops, layer_id, group
        self.group_index = GROUPS.index(group)
        self.segments = pool.shapes[group].segments
        self.name = f"{base.name}+lora"

    def process_weights(self, layer: nn.Module) -> None:
        self.base.process_weights(layer)

    def dequantize(self, layer: nn.Module) -> torch.Tensor:
        return self.base.dequantize(layer)

    def nbytes(self, layer: nn.Module) -> int:
        return self.base.nbytes(layer)

    def packed_weight(self, layer: nn.Module):
        return self.base.packed_weight(layer)  # the fused step adds the deltas itself (csrc/cpu_lora.h)

    def apply(self, layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
        y = self.base.apply(layer, x)
        ctx = get_forward_context()
        if ctx.lora is None:
            return y
        rows = ctx.lora.rows_for(x.shape[0], ctx.keep_rows)
        if rows is None:
            return y
        pool, i = self.pool, self.layer_id
        self.ops.lora_delta_(y, x, pool.a[i][self.group], pool.b[i][self.group], pool.scales,
                             pool.ranks[i, :, self.group_index], self.segments, rows)
        return y


def attach(model: nn.Module, pool: LoRAPool, ops) -> None:
    """Wrap the linear method of every merged projection the pool holds weights for (after `ops.install`, which
    sets the base methods)."""
    for i, layer in enumerate(model.layers):
        for group in pool.groups:
            parent = layer.self_attn if group in ("qkv_proj", "o_proj") else layer.mlp
            linear = getattr(parent, group)
            shape = pool.shapes[group]
            if (linear.in_features, linear.out_features) != (shape.in_features, sum(shape.out_sizes)):
                raise ValueError(f"LoRA: layer {i} {group} maps {linear.in_features} -> {linear.out_features}, not "
                                 f"the model's {shape.in_features} -> {sum(shape.out_sizes)}: LoRA adapters need "
                                 f"whole (not tensor-parallel sharded) projections")
            base = linear.method.base if isinstance(linear.method, LoRALinearMethod) else linear.method
            linear.method = LoRALinearMethod(base, pool, ops, i, group)
