"""Linear layers split for tensor parallelism (tp size 1 for now; the split logic is already in place).

Column-parallel layers shard the output features, row-parallel ones the input features; each parameter
carries a `weight_loader` that copies the rank's shard of a full checkpoint tensor, and the dims it shards
(`new_param`), so that the same loaders take quantized tensors (packed along one dim, grouped along another).
How a layer keeps and applies its weight is its `LinearMethod` (the quantization package has one per format).
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
              input_dim: int | None, output_pack: int = 1) -> nn.Parameter:
    """A checkpoint-filled parameter and where its loader finds the sharded dims: output_dim (column-parallel
    layers shard it; merged layers place their parts along it, `output_pack` output features per element, e.g.
    8 for nibbles packed in an int32) and input_dim (row-parallel layers shard it); None: not along that dim."""
    p = nn.Parameter(torch.empty(shape, dtype=dtype), requires_grad=False)
    p.weight_loader, p.output_dim, p.input_dim, p.output_pack = loader, output_dim, input_dim, output_pack
    return p


class TPInfo:
    rank: int = 0
    size: int = 1


def _shard(t: torch.Tensor, dim: int) -> torch.Tensor:
    if TPInfo.size == 1:
        return t
    n = t.shape[dim] // TPInfo.size
    return t.narrow(dim, TPInfo.rank * n, n)


class LinearBase(nn.Module):
    """weight (out, in) [+ bias], applied by `method` (dense until the ops set installs the device's method for the
    model's quantization, which may replace the weight by other parameters before loading and re-lay it out after:
    see LinearMethod). `packed` holds the method's layout where it is not a parameter."""

    method: LinearMethod = DENSE

    def __init__(self, in_features: int, out_features: int, bias: bool) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.dtype = torch.get_default_dtype()  # the activations' dtype (the model's)
        self.weight = new_param((out_features, in_features), None, self.weight_loader, 0, 1)
        self.bias = new_param((out_features,), None, self.weight_loader, 0, None) if bias else None
        self.packed = None

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        raise NotImplementedError

    def set_linear_method(self, method: LinearMethod) -> None:
        """Before the weights are loaded: the method makes the parameters the checkpoint fills."""
        self.method = method
        method.create_weights(self)

    def process_weights(self) -> None:
        """After loading: the method's layout (which may replace the method: GGUF picks one per tensor type)."""
        self.method.process_weights(self)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.method.apply(self, x)


def _copy(param: torch.Tensor, loaded: torch.Tensor, fill: bool = False) -> None:
    """param <- loaded of the same shape; with `fill` (a scale stored per tensor or per row), a single value fills
    param."""
    if fill and loaded.numel() == 1:
        param.data.fill_(loaded.reshape(()).item())
        return
    if param.shape != loaded.shape:
        raise ValueError(f"weight shape mismatch: expected {tuple(param.shape)}, got {tuple(loaded.shape)}")
    param.data.copy_(loaded)


def _shard_out(param: nn.Parameter, loaded: torch.Tensor) -> torch.Tensor:
    return _shard(loaded, param.output_dim) if param.output_dim is not None and loaded.dim() > param.output_dim \
        else loaded


def _place(param: nn.Parameter, offset: int, size: int, loaded: torch.Tensor) -> None:
    """One part of a merged layer (output features [offset, offset + size)) into `param`. A parameter with no output
    dim (GPTQ's g_idx) is shared by the parts: they must agree."""
    fill = getattr(param, "fill", False)
    if param.output_dim is None:
        if getattr(param, "placed", False) and not torch.equal(param.data, loaded.to(param.dtype)):
            raise ValueError("the merged projections' tensors of this name differ; they must be equal")
        _copy(param, loaded, fill)
        param.placed = True
        return
    pack = param.output_pack
    _copy(param.data.narrow(param.output_dim, offset // pack, size // pack), _shard_out(param, loaded), fill)


class ColumnParallelLinear(LinearBase):
    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        super().__init__(in_features, out_features // TPInfo.size, bias)

    def weight_loader(self, param, loaded, shard_id=None):
        _copy(param, _shard_out(param, loaded), getattr(param, "fill", False))


class RowParallelLinear(LinearBase):
    """Input features sharded; with tp > 1 the partial outputs are summed (all-reduce) after forward."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        super().__init__(in_features // TPInfo.size, out_features, bias)

    def weight_loader(self, param, loaded, shard_id=None):
        sharded = param.input_dim is not None and loaded.dim() > param.input_dim
        _copy(param, _shard(loaded, param.input_dim) if sharded else loaded, getattr(param, "fill", False))


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel outputs in one matmul (gate and up projections)."""

    def __init__(self, in_features: int, out_sizes: list[int], bias: bool = False) -> None:
        super().__init__(in_features, sum(out_sizes), bias)
        self.out_sizes = [n // TPInfo.size for n in out_sizes]

    def weight_loader(self, param, loaded, shard_id=None):
        _place(param, sum(self.out_sizes[:shard_id]), self.out_sizes[shard_id], loaded)


class QKVParallelLinear(ColumnParallelLinear):
    """Q, K and V projections in one matmul; shard ids "q", "k", "v"."""

    def __init__(self, hidden: int, head_dim: int, num_heads: int, num_kv_heads: int, bias: bool) -> None:
        self.q_size = num_heads * head_dim // TPInfo.size
        self.kv_size = max(1, num_kv_heads // TPInfo.size) * head_dim
        super().__init__(hidden, (self.q_size + 2 * self.kv_size) * TPInfo.size, bias)

    def weight_loader(self, param, loaded, shard_id=None):
        offset, size = {"q": (0, self.q_size), "k": (self.q_size, self.kv_size),
                        "v": (self.q_size + self.kv_size, self.kv_size)}[shard_id]
        _place(param, offset, size, loaded)
