"""Linear layers split for tensor parallelism (tp size 1 for now; the split logic is already in place).

Column-parallel layers shard the output features, row-parallel ones the input features; each parameter
carries a `weight_loader` that copies the rank's shard of a full checkpoint tensor.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def pack_weight(weight: torch.Tensor, batch_hint: int = 1) -> torch.Tensor | None:
    """On the CPU, `weight` (out, in) reordered into oneDNN's blocked layout, which its matmul streams
    1.3-2x faster than a plain row-major weight at every batch size (measured by bench_forward); None
    where that does not apply (another device or dtype, or a torch without oneDNN)."""
    if weight.device.type != "cpu" or weight.dtype not in (torch.float32, torch.bfloat16):
        return None
    if not torch.backends.mkldnn.is_available():
        return None
    try:
        return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), batch_hint)
    except (RuntimeError, AttributeError):
        return None


def packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


class LinearMethod:
    """How a linear layer keeps and applies its weight: one method per weight layout (quantized formats will be
    more of them), chosen by the device's ops set and set on each layer once its weights are loaded."""

    name = "?"

    def process_weights(self, layer: nn.Module) -> None:
        """After loading: derive what `apply` needs from layer.weight / layer.bias."""

    def apply(self, layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError


class DenseLinear(LinearMethod):
    """The weight as loaded, through F.linear."""

    name = "dense"

    def process_weights(self, layer):
        layer.packed = None

    def apply(self, layer, x):
        return F.linear(x, layer.weight, layer.bias)


class OneDnnPackedLinear(LinearMethod):
    """On the CPU, a oneDNN-packed copy of the weight for the matmul (see pack_weight); the dense weight stays
    the parameter (the fused decode step repacks it, checkpoints and tests read it). Dense where packing does
    not apply."""

    name = "onednn-packed"

    def process_weights(self, layer):
        layer.packed = pack_weight(layer.weight)

    def apply(self, layer, x):
        if layer.packed is None:
            return F.linear(x, layer.weight, layer.bias)
        return packed_linear(x, layer.packed, layer.bias)


DENSE, ONEDNN_PACKED = DenseLinear(), OneDnnPackedLinear()


class TPInfo:
    rank: int = 0
    size: int = 1


def _shard(t: torch.Tensor, dim: int) -> torch.Tensor:
    if TPInfo.size == 1:
        return t
    n = t.shape[dim] // TPInfo.size
    return t.narrow(dim, TPInfo.rank * n, n)


class LinearBase(nn.Module):
    """weight (out, in) [+ bias], applied by `method` (dense until the ops set installs its method)."""

    method: LinearMethod = DENSE

    def __init__(self, in_features: int, out_features: int, bias: bool) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)
        self.weight.weight_loader = self.weight_loader
        self.bias = None
        if bias:
            self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False)
            self.bias.weight_loader = self.weight_loader
        self.packed: torch.Tensor | None = None  # the oneDNN-packed method's copy of the weight

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        raise NotImplementedError

    def set_linear_method(self, method: LinearMethod) -> None:
        """After the weights are loaded (the method may derive its layout from them)."""
        self.method = method
        method.process_weights(self)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.method.apply(self, x)


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
