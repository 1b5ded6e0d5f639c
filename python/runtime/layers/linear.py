"""Linear layers split for tensor parallelism (tp size 1 for now; the split logic is already in place).

Column-parallel layers shard the output features, row-parallel ones the input features; each parameter
carries a `weight_loader` that copies the rank's shard of a full checkpoint tensor.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class TPInfo:
    rank: int = 0
    size: int = 1


def _shard(t: torch.Tensor, dim: int) -> torch.Tensor:
    if TPInfo.size == 1:
        return t
    n = t.shape[dim] // TPInfo.size
    return t.narrow(dim, TPInfo.rank * n, n)


class LinearBase(nn.Module):
    def __init__(self, in_features: int, out_features: int, bias: bool) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)
        self.weight.weight_loader = self.weight_loader
        self.bias = None
        if bias:
            self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False)
            self.bias.weight_loader = self.weight_loader

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        raise NotImplementedError

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


def _copy(param: torch.Tensor, loaded: torch.Tensor) -> None:
    if param.shape != loaded.shape:
        raise ValueError(f"weight shape mismatch: expected {tuple(param.shape)}, got {tuple(loaded.shape)}")
    param.data.copy_(loaded)


class ColumnParallelLinear(LinearBase):
    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        super().__init__(in_features, out_features // TPInfo.size, bias)

    def weight_loader(self, param, loaded, shard_id=None):
        _copy(param, _shard(loaded, 0))


class RowParallelLinear(LinearBase):
    """Input features sharded; with tp > 1 the partial outputs are summed (all-reduce) after forward."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        super().__init__(in_features // TPInfo.size, out_features, bias)

    def weight_loader(self, param, loaded, shard_id=None):
        _copy(param, _shard(loaded, 1) if param.dim() == 2 else loaded)


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel outputs in one matmul (gate and up projections)."""

    def __init__(self, in_features: int, out_sizes: list[int], bias: bool = False) -> None:
        super().__init__(in_features, sum(out_sizes), bias)
        self.out_sizes = [n // TPInfo.size for n in out_sizes]

    def weight_loader(self, param, loaded, shard_id=None):
        start = sum(self.out_sizes[:shard_id])
        _copy(param.data.narrow(0, start, self.out_sizes[shard_id]), _shard(loaded, 0))


class QKVParallelLinear(ColumnParallelLinear):
    """Q, K and V projections in one matmul; shard ids "q", "k", "v"."""

    def __init__(self, hidden: int, head_dim: int, num_heads: int, num_kv_heads: int, bias: bool) -> None:
        self.q_size = num_heads * head_dim // TPInfo.size
        self.kv_size = max(1, num_kv_heads // TPInfo.size) * head_dim
        super().__init__(hidden, (self.q_size + 2 * self.kv_size) * TPInfo.size, bias)

    def weight_loader(self, param, loaded, shard_id=None):
        offset, size = {"q": (0, self.q_size), "k": (self.q_size, self.kv_size),
                        "v": (self.q_size + self.kv_size, self.kv_size)}[shard_id]
        _copy(param.data.narrow(0, offset, size), _shard(loaded, 0))
