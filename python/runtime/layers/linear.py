"""Linear layers split for tensor parallelism over the tp axis they are built with (parallel_context.ParallelAxis:
the rank, the size and the all-reduce; the one-rank axis by default).

Column-parallel layers hold a range of the output features, row-parallel ones a range of the input features
and sum their partial outputs over the tensor-parallel ranks (all-reduce) after the matmul. Each parameter
carries a `weight_loader` that copies the rank's part of a checkpoint tensor, and the dims it runs along
(`new_param`), so that the same loaders take quantized tensors (packed along one dim, grouped along another):
`loaded` is a torch tensor, a executor.weights.CheckpointSlice or a GGUF tensor, and only its `shape` and `narrow` are
called before the part is read, so a sharded load reads only the rank's part. How a layer keeps and applies its
weight is its `LinearMethod` (the quantization package has one per format).
"""

from __future__ import annotations

import math
from functools import partial

import torch
import torch.nn.functional as F
from torch import nn

from radixgen.runtime.ground.parallel_context import SINGLE, ParallelAxis
from radixgen.runtime.ground.sharding import head_shard, split_range


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
    """How a linear layer keeps and applies its weight: one method per weight format and device (the quantization
    package holds them), chosen by the device's ops set before the weights are loaded.

    `create_weights` gives the layer the parameters its checkpoint's tensors load into (quantized checkpoints have
    other names and shapes than the dense `weight` LinearBase makes), `process_weights` re-lays them out, after
    loading, into the one layout `apply` reads, dropping what the checkpoint needed: a layer holds one copy of its
    weight. `dequantize` is the dense weight the layer computes with (tests, and switching layouts), `embed` reads
    rows of it (the embedding of a tied LM head), `nbytes` what the layout takes, `packed_weight` the C
    descriptor the fused CPU decode step reads (None where the layout is not one of csrc/cpu_linear.h's)."""

    name = "?"

    def create_weights(self, layer: LinearBase) -> None:
        """Before loading: the parameters the checkpoint fills (by default the dense weight the layer made)."""

    def process_weights(self, layer: LinearBase) -> None:
        """After loading: the layout `apply` reads, derived from the loaded parameters."""

    def apply(self, layer: LinearBase, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def dequantize(self, layer: LinearBase) -> torch.Tensor:
        """The dense (out, in) float32 weight this layer computes with."""
        raise NotImplementedError

    def embed(self, layer: LinearBase, ids: torch.Tensor) -> torch.Tensor:
        """Rows `ids` of the weight in the layer's activation dtype (a tied LM head's embedding lookup)."""
        return F.embedding(ids, self.dequantize(layer).to(layer.dtype))

    def nbytes(self, layer: LinearBase) -> int:
        return sum(t.numel() * t.element_size() for t in (*layer.parameters(recurse=False),
                                                          *layer.buffers(recurse=False)))

    def packed_weight(self, layer: LinearBase):
        return None


class DenseLinear(LinearMethod):
    """The weight as loaded, through F.linear."""

    name = "dense"

    def apply(self, layer, x):
        return F.linear(x, layer.weight, layer.bias)

    def dequantize(self, layer):
        return layer.weight.float()

    def embed(self, layer, ids):
        return F.embedding(ids, layer.weight)


DENSE = DenseLinear()


def new_param(shape: tuple[int, ...], dtype: torch.dtype | None, loader, output_dim: int | None,
              input_dim: int | None, output_pack: int = 1, input_pack: int = 1) -> nn.Parameter:
    """A checkpoint-filled parameter and where its loader finds the split dims: output_dim (column-parallel layers
    take a range of it; merged layers place their parts along it), `output_pack` output features per element
    (e.g. 8 for nibbles packed in an int32), and input_dim (row-parallel layers take a range of it), `input_pack`
    input features per element (8 for GPTQ's packed rows, the group size for group scales and zeros); None: the
    parameter does not run along that dim (every part, or every rank, loads it whole)."""
    p = nn.Parameter(torch.empty(shape, dtype=dtype), requires_grad=False)
    p.weight_loader, p.output_dim, p.input_dim = loader, output_dim, input_dim
    p.output_pack, p.input_pack = output_pack, input_pack
    return p


class LinearBase(nn.Module):
    """weight (out, in) [+ bias], applied by `method` (dense until the ops set installs the device's method for the
    model's quantization, which may replace the weight by other parameters before loading and re-lay it out after:
    see LinearMethod). `packed` holds the method's layout where it is not a parameter.

    Loading: the rank's part of a checkpoint tensor is its output features `out_part(shard_id)` and input features
    `in_part` (the whole layer by default; the parallel layers below narrow them), cut from each parameter along
    the dims new_param gave it (`checkpoint_part`)."""

    method: LinearMethod = DENSE
    tp: ParallelAxis = SINGLE.tp  # the axis the parallel layers below split over

    def __init__(self, in_features: int, out_features: int, bias: bool) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.dtype = torch.get_default_dtype()  # the activations' dtype (the model's)
        self.weight = new_param((out_features, in_features), None, self.weight_loader, 0, 1)
        self.bias = new_param((out_features,), None, self.weight_loader, 0, None) if bias else None
        self.packed = None

    def out_part(self, shard_id) -> tuple[int, int, int, int]:
        """Checkpoint part `shard_id` along the output features: (offset in this layer, first feature in the
        checkpoint tensor, features, the checkpoint tensor's features)."""
        return 0, 0, self.out_features, self.out_features

    @property
    def in_part(self) -> tuple[int, int, int]:
        """This layer's input features in the checkpoint: (first, features, the checkpoint tensor's features)."""
        return 0, self.in_features, self.in_features

    def checkpoint_part(self, param: nn.Parameter, loaded, shard_id=None):
        """The part of checkpoint tensor `loaded` (a torch tensor or anything with its `shape` and `narrow`: an
        executor.weights.CheckpointSlice, a GGUF tensor) that `param` holds, not read yet where `loaded` is lazy. A
        scale stored as one value for the whole tensor (param.fill) is the same for every part."""
        if getattr(param, "fill", False) and math.prod(loaded.shape) == 1:
            return loaded
        if param.output_dim is not None:
            _, start, size, full = self.out_part(shard_id)
            loaded = _features(loaded, param.output_dim, param.output_pack, full, start, size, self.tp.size)
        if param.input_dim is not None:
            start, size, full = self.in_part
            loaded = _features(loaded, param.input_dim, param.input_pack, full, start, size, self.tp.size)
        return loaded

    def weight_loader(self, param: nn.Parameter, loaded, shard_id=None) -> None:
        """param <- this rank's part of `loaded`, at part `shard_id`'s place. A parameter with no output dim (GPTQ's
        g_idx) is shared by a merged layer's parts: they must agree."""
        part = _whole(self.checkpoint_part(param, loaded, shard_id))
        fill = getattr(param, "fill", False)
        if param.output_dim is None:
            if getattr(param, "placed", False) and not torch.equal(param.data, part.to(param.dtype)):
                raise ValueError("the merged projections' tensors of this name differ; they must be equal")
            _copy(param.data, part, fill)
            param.placed = True
            return
        offset, _, size, _ = self.out_part(shard_id)
        pack = param.output_pack
        _copy(param.data.narrow(param.output_dim, offset // pack, size // pack), part, fill)

    def set_linear_method(self, method: LinearMethod) -> None:
        """Before the weights are loaded: the method makes the parameters the checkpoint fills."""
        self.method = method
        method.create_weights(self)

    def process_weights(self) -> None:
        """After loading: the method's layout (which may replace the method: GGUF picks one per tensor type)."""
        self.method.process_weights(self)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.method.apply(self, x)


def _narrow(loaded, dim: int, full: int, start: int, size: int):
    """Rows (dim 0) or columns (dim 1) [start, start + size) of a checkpoint tensor whose dim must be `full`."""
    if len(loaded.shape) <= dim or loaded.shape[dim] != full:
        raise ValueError(f"weight shape mismatch: expected {full} along dim {dim}, got {tuple(loaded.shape)}")
    return loaded.narrow(dim, start, size)


def _features(loaded, dim: int, pack: int, full: int, start: int, size: int, tp_size: int):
    """Features [start, start + size) of the `full` ones along dim `dim` of a checkpoint tensor holding `pack`
    features per element (packed values, or a group's scale): the split must fall on those elements' bounds."""
    if pack > 1 and (start % pack or size % pack):
        raise ValueError(f"this rank's features [{start}, {start + size}) of {full} do not fall on the tensor's "
                         f"elements of {pack} features (packed values or a group's scale): tensor parallelism "
                         f"cannot split it there (tp_size={tp_size})")
    return _narrow(loaded, dim, full // pack, start // pack, size // pack)


def _whole(loaded) -> torch.Tensor:
    """A checkpoint tensor as a torch tensor (a executor.weights.CheckpointSlice is read here)."""
    return loaded if isinstance(loaded, torch.Tensor) else loaded.read()


def _copy(param: torch.Tensor, loaded: torch.Tensor, fill: bool = False) -> None:
    """param <- loaded of the same shape; with `fill` (a scale stored per tensor, or per row as (rows,) or
    (rows, 1)), a single value fills param."""
    if fill and loaded.numel() == 1:
        param.fill_(loaded.reshape(()).item())
        return
    if fill and loaded.dim() == 2 and loaded.shape[1] == 1:
        loaded = loaded.reshape(-1)
    if param.shape != loaded.shape:
        raise ValueError(f"weight shape mismatch: expected {tuple(param.shape)}, got {tuple(loaded.shape)}")
    param.copy_(loaded)


class ColumnParallelLinear(LinearBase):
    """Output features [out_start, out_start + out_features) of the full layer: by default this rank's share."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False, *,
                 tp: ParallelAxis = SINGLE.tp) -> None:
        self.full_out, self.tp = out_features, tp
        self.out_start, size = split_range(out_features, tp.size, tp.rank)
        super().__init__(in_features, size, bias)

    def out_part(self, shard_id):
        return 0, self.out_start, self.out_features, self.full_out


class RowParallelLinear(LinearBase):
    """Input features [in_start, in_start + in_features) of the full layer (default: this rank's share, or
    `in_range` = (start, size)); the partial outputs are summed over the tensor-parallel ranks. A bias is added
    once: rank 0 holds it, the others a zero one.

    `shares` (tp_size, tp_rank) -> (start, size): how a group of any size would cut the input features (default:
    split_range; a layer given only `in_range` does not say). The deterministic mode sums tp 2's cut as fixed
    segments whatever the group (layers/fixed_order.py, which sets `ordered_sum` at tp > 1)."""

    ordered_sum = None  # the deterministic mode at tp > 1: its fixed_order.OrderedSum replaces the all-reduce

    def __init__(self, in_features: int, out_features: int, bias: bool = False,
                 in_range: tuple[int, int] | None = None, *, tp: ParallelAxis = SINGLE.tp, shares=None) -> None:
        self.full_in, self.tp = in_features, tp
        self.shares = shares or (None if in_range else partial(split_range, in_features))
        self.in_start, size = in_range or self.shares(tp.size, tp.rank)
        super().__init__(size, out_features, bias)

    @property
    def in_part(self):
        return self.in_start, self.in_features, self.full_in

    def weight_loader(self, param, loaded, shard_id=None):
        if param is self.bias and self.tp.rank != 0:
            if tuple(loaded.shape) != tuple(param.shape):
                raise ValueError(f"bias shape mismatch: expected {tuple(param.shape)}, got {tuple(loaded.shape)}")
            param.data.zero_()
            return
        super().weight_loader(param, loaded, shard_id)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.ordered_sum is not None:
            return self.ordered_sum.linear(self, x)
        return self.tp.all_reduce(super().forward(x))


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel outputs in one matmul (gate and up projections): this rank's share of each."""

    def __init__(self, in_features: int, out_sizes: list[int], bias: bool = False, *,
                 tp: ParallelAxis = SINGLE.tp) -> None:
        self.full_sizes, self.tp = list(out_sizes), tp
        self.parts = [split_range(n, tp.size, tp.rank) for n in out_sizes]
        self.out_sizes = [size for _, size in self.parts]
        LinearBase.__init__(self, in_features, sum(self.out_sizes), bias)

    def out_part(self, shard_id):
        start, size = self.parts[shard_id]
        return sum(self.out_sizes[:shard_id]), start, size, self.full_sizes[shard_id]


class QKVParallelLinear(ColumnParallelLinear):
    """Q, K and V projections in one matmul (shard ids "q", "k", "v"), for this rank's heads (`heads`, a
    sharding.HeadShard): the query heads and the KV heads they read."""

    def __init__(self, hidden: int, head_dim: int, num_heads: int, num_kv_heads: int, bias: bool, *,
                 tp: ParallelAxis = SINGLE.tp) -> None:
        self.tp = tp
        self.heads = head_shard(num_heads, num_kv_heads, tp.size, tp.rank)
        self.full_rows = {"q": num_heads * head_dim, "k": num_kv_heads * head_dim, "v": num_kv_heads * head_dim}
        self.q_size = self.heads.num_heads * head_dim
        self.kv_size = self.heads.num_kv_heads * head_dim
        self.head_dim = head_dim
        LinearBase.__init__(self, hidden, self.q_size + 2 * self.kv_size, bias)

    def out_part(self, shard_id):
        d, heads = self.head_dim, self.heads
        # (offset in our rows, first row in the checkpoint tensor, rows)
        offset, src, size = {"q": (0, heads.q_start * d, self.q_size),
                             "k": (self.q_size, heads.kv_start * d, self.kv_size),
                             "v": (self.q_size + self.kv_size, heads.kv_start * d, self.kv_size)}[shard_id]
        return offset, src, size, self.full_rows[shard_id]
