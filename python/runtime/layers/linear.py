"""Linear layers split for tensor parallelism (runtime/distributed.py holds the ranks and the collectives).

Column-parallel layers hold a range of the output features, row-parallel ones a range of the input features
and sum their partial outputs over the tensor-parallel ranks (all-reduce) after the matmul. Each parameter
carries a `weight_loader` that copies the rank's part of a checkpoint tensor: `loaded` is a torch tensor or a
loader.CheckpointSlice, and only its `narrow` is called, so a sharded load reads only the rank's part.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from radixgen.runtime import distributed
from radixgen.runtime.distributed import head_shard, split_range


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


def _narrow(loaded, dim: int, full: int, start: int, size: int) -> torch.Tensor:
    """Rows (dim 0) or columns (dim 1) [start, start + size) of a checkpoint tensor whose dim must be `full`."""
    if len(loaded.shape) <= dim or loaded.shape[dim] != full:
        raise ValueError(f"weight shape mismatch: expected {full} along dim {dim}, got {tuple(loaded.shape)}")
    return loaded.narrow(dim, start, size)


def _copy(param: torch.Tensor, loaded: torch.Tensor) -> None:
    if param.shape != loaded.shape:
        raise ValueError(f"weight shape mismatch: expected {tuple(param.shape)}, got {tuple(loaded.shape)}")
    param.data.copy_(loaded)


class ColumnParallelLinear(LinearBase):
    """Output features [out_start, out_start + out_features) of the full layer: by default this rank's share."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        self.full_out = out_features
        self.out_start, size = split_range(out_features, distributed.tp_size(), distributed.tp_rank())
        super().__init__(in_features, size, bias)

    def weight_loader(self, param, loaded, shard_id=None):
        _copy(param, _narrow(loaded, 0, self.full_out, self.out_start, param.shape[0]))


class RowParallelLinear(LinearBase):
    """Input features [in_start, in_start + in_features) of the full layer (default: this rank's share, or
    `in_range` = (start, size)); the partial outputs are summed over the tensor-parallel ranks. A bias is added
    once: rank 0 holds it, the others a zero one."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False,
                 in_range: tuple[int, int] | None = None) -> None:
        self.full_in = in_features
        self.in_start, size = in_range or split_range(in_features, distributed.tp_size(), distributed.tp_rank())
        super().__init__(size, out_features, bias)

    def weight_loader(self, param, loaded, shard_id=None):
        if param.dim() == 2:
            _copy(param, _narrow(loaded, 1, self.full_in, self.in_start, param.shape[1]))
        elif distributed.tp_rank() == 0:
            _copy(param, _narrow(loaded, 0, param.shape[0], 0, param.shape[0]))
        else:
            param.data.zero_()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return distributed.all_reduce(super().forward(x))


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel outputs in one matmul (gate and up projections): this rank's share of each."""

    def __init__(self, in_features: int, out_sizes: list[int], bias: bool = False) -> None:
        self.full_sizes = list(out_sizes)
        self.parts = [split_range(n, distributed.tp_size(), distributed.tp_rank()) for n in out_sizes]
        self.out_sizes = [size for _, size in self.parts]
        LinearBase.__init__(self, in_features, sum(self.out_sizes), bias)

    def weight_loader(self, param, loaded, shard_id=None):
        start, size = self.parts[shard_id]
        _copy(param.data.narrow(0, sum(self.out_sizes[:shard_id]), size),
              _narrow(loaded, 0, self.full_sizes[shard_id], start, size))


class QKVParallelLinear(ColumnParallelLinear):
    """Q, K and V projections in one matmul (shard ids "q", "k", "v"), for this rank's heads (`heads`, a
    distributed.HeadShard): the query heads and the KV heads they read."""

    def __init__(self, hidden: int, head_dim: int, num_heads: int, num_kv_heads: int, bias: bool) -> None:
        self.heads = head_shard(num_heads, num_kv_heads, distributed.tp_size(), distributed.tp_rank())
        self.full_rows = {"q": num_heads * head_dim, "k": num_kv_heads * head_dim, "v": num_kv_heads * head_dim}
        self.q_size = self.heads.num_heads * head_dim
        self.kv_size = self.heads.num_kv_heads * head_dim
        self.head_dim = head_dim
        LinearBase.__init__(self, hidden, self.q_size + 2 * self.kv_size, bias)

    def weight_loader(self, param, loaded, shard_id=None):
        d, heads = self.head_dim, self.heads
        # (offset in our rows, first row in the checkpoint tensor, rows)
        offset, src, size = {"q": (0, heads.q_start * d, self.q_size),
                             "k": (self.q_size, heads.kv_start * d, self.kv_size),
                             "v": (self.q_size + self.kv_size, heads.kv_start * d, self.kv_size)}[shard_id]
        _copy(param.data.narrow(0, offset, size), _narrow(loaded, 0, self.full_rows[shard_id], src, size))
