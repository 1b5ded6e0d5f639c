"""Grouped experts: E experts' linear layers of one shape in one layer (`GroupedLinear`), held in one layout that
its method creates, and applied to rows grouped by expert (the first counts[0] rows are expert 0's, the next
counts[1] expert 1's, ...), the form an expert block's dispatch hands them over in (`group_by_expert`).

The methods here are the torch references: bf16 / float weights as loaded (`DenseGroupedLinear`), and a weight
format's values and scales stacked over the experts (`QuantizedGroupedLinear` over an `ExpertFormat`: int8 now;
int4 or GGUF blocks are another format whose `quantize` gives a QuantizedWeight of 4 bits, stacked the same
way). A grouped C or Triton kernel would be another method over the same layer. No model builds one yet.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from radixgen.runtime.layers.quantization.base import QuantizedWeight


def group_by_expert(expert_ids: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, list[int]]:
    """(order, counts): rows `order` of the flattened (T,) or (T, top_k) `expert_ids` put the rows of each expert
    together, experts in order (stable within one), counts[e] rows for expert e. A row of the input is
    order[i] // top_k for a (T, top_k) assignment."""
    flat = expert_ids.reshape(-1).to(torch.int64)
    if flat.numel() and (int(flat.min()) < 0 or int(flat.max()) >= num_experts):
        raise ValueError(f"expert ids must be in [0, {num_experts}), got [{int(flat.min())}, {int(flat.max())}]")
    order = torch.argsort(flat, stable=True)
    return order, torch.bincount(flat, minlength=num_experts).tolist()


class GroupedLinearMethod:
    """How a GroupedLinear keeps and applies its experts' weights: `create_weights` the parameters the checkpoint's
    per-expert tensors load into, `process_weights` the method's one layout of all experts, `apply` rows grouped by
    expert, `dequantize` expert e's dense (out, in) float32 weight, `nbytes` what the layout takes."""

    name = "?"

    def create_weights(self, layer: GroupedLinear) -> None:
        """Before loading (default: the dense (E, out, in) weight the layer made)."""

    def process_weights(self, layer: GroupedLinear) -> None:
        """After loading."""

    def apply(self, layer: GroupedLinear, x: torch.Tensor, counts: list[int]) -> torch.Tensor:
        raise NotImplementedError

    def dequantize(self, layer: GroupedLinear, expert: int) -> torch.Tensor:
        raise NotImplementedError

    def nbytes(self, layer: GroupedLinear) -> int:
        return sum(t.numel() * t.element_size() for t in (*layer.parameters(recurse=False),
                                                          *layer.buffers(recurse=False)))


def _groups(x: torch.Tensor, counts: list[int]):
    """(expert, rows [start, end)) of each expert with rows."""
    start = 0
    for e, n in enumerate(counts):
        if n:
            yield e, start, start + n
        start += n


class DenseGroupedLinear(GroupedLinearMethod):
    """The (E, out, in) weight as loaded, in the model's dtype: one F.linear per expert with rows."""

    name = "dense (grouped, torch)"

    def apply(self, layer, x, counts):
        out = x.new_empty((x.shape[0], layer.out_features))
        for e, s, t in _groups(x, counts):
            out[s:t] = F.linear(x[s:t], layer.weight[e])
        return out

    def dequantize(self, layer, expert):
        return layer.weight[expert].float()


class ExpertFormat:
    """A weight format for experts: an expert's values and scales from its loaded float (out, in) weight."""

    name = "?"

    def quantize(self, w: torch.Tensor) -> QuantizedWeight:
        raise NotImplementedError


class Int8Experts(ExpertFormat):
    """int8 per output channel, as the dense layers' int8 (w = scale * q, scale = max |row| / 127)."""

    name = "int8"

    def quantize(self, w):
        return QuantizedWeight.int8_from(w)


INT8_EXPERTS = Int8Experts()


class QuantizedGroupedLinear(GroupedLinearMethod):
    """A format's values and scales of every expert stacked: q (E, out, in), scales and offsets (E, out, groups);
    each expert with rows dequantized to x's dtype at the call and applied by F.linear (the reference)."""

    def __init__(self, fmt: ExpertFormat) -> None:
        self.fmt = fmt
        self.name = f"{fmt.name} (grouped, torch)"

    def process_weights(self, layer):
        parts = [self.fmt.quantize(layer.weight[e].detach()) for e in range(layer.num_experts)]
        first = parts[0]
        if any((p.bits, p.group, p.zero_points, p.perm is None) != (first.bits, first.group, first.zero_points, True)
               for p in parts):
            raise ValueError(f"{self.fmt.name}: the experts' quantized weights are not of one kind")
        layer.weight = None  # one copy: the stacked values below
        layer.register_buffer("q", torch.stack([p.q for p in parts]), persistent=False)
        layer.register_buffer("scales", torch.stack([p.scales for p in parts]), persistent=False)
        offsets = None if first.offsets is None else torch.stack([p.offsets for p in parts])
        layer.register_buffer("offsets", offsets, persistent=False)
        layer.bits, layer.group, layer.zero_points = first.bits, first.group, first.zero_points

    def expert(self, layer, e: int) -> QuantizedWeight:
        """Expert e's QuantizedWeight: views into the stacked layout."""
        return QuantizedWeight(layer.bits, layer.q[e], layer.scales[e], layer.group,
                               None if layer.offsets is None else layer.offsets[e], layer.zero_points)

    def apply(self, layer, x, counts):
        out = x.new_empty((x.shape[0], layer.out_features))
        for e, s, t in _groups(x, counts):
            out[s:t] = F.linear(x[s:t], self.expert(layer, e).dequantize().to(x.dtype))
        return out

    def dequantize(self, layer, expert):
        return self.expert(layer, expert).dequantize()


DENSE_GROUPED = DenseGroupedLinear()
_FORMATS = {"int8": INT8_EXPERTS}


def grouped_method(quantization: str) -> GroupedLinearMethod:
    """The grouped-expert method of weight format `quantization` (a QuantSpec's method name)."""
    if quantization == "none":
        return DENSE_GROUPED
    if quantization in _FORMATS:
        return QuantizedGroupedLinear(_FORMATS[quantization])
    raise ValueError(f"quantization {quantization!r} has no grouped-expert form yet (supported for experts: none, "
                     f"{', '.join(_FORMATS)})")


class GroupedLinear(nn.Module):
    """E experts' (out, in) linear layers, no bias. Loading: `weight_loader(param, tensor, expert)` copies one
    expert's checkpoint tensor into its place; then `process_weights` hands them to the method's layout.
    forward(x, counts): x (T, in) grouped by expert (counts[e] rows each, in expert order) -> (T, out)."""

    def __init__(self, num_experts: int, in_features: int, out_features: int,
                 method: GroupedLinearMethod = DENSE_GROUPED) -> None:
        super().__init__()
        self.num_experts, self.in_features, self.out_features = num_experts, in_features, out_features
        self.dtype = torch.get_default_dtype()
        self.weight = nn.Parameter(torch.empty(num_experts, out_features, in_features), requires_grad=False)
        self.weight.weight_loader = self.weight_loader
        self.method = method
        method.create_weights(self)

    def weight_loader(self, param: nn.Parameter, loaded, expert: int) -> None:
        if not 0 <= expert < self.num_experts:
            raise ValueError(f"expert {expert} is outside [0, {self.num_experts})")
        if tuple(loaded.shape) != tuple(param.shape[1:]):
            raise ValueError(f"expert {expert}'s weight: expected {tuple(param.shape[1:])}, got {tuple(loaded.shape)}")
        param.data[expert].copy_(loaded if isinstance(loaded, torch.Tensor) else loaded.read())

    def process_weights(self) -> None:
        self.method.process_weights(self)

    def forward(self, x: torch.Tensor, counts: list[int]) -> torch.Tensor:
        if len(counts) != self.num_experts or sum(counts) != x.shape[0] or min(counts, default=0) < 0:
            raise ValueError(f"counts {counts} must be {self.num_experts} non-negative counts summing to the "
                             f"{x.shape[0]} rows")
        return self.method.apply(self, x, counts)
