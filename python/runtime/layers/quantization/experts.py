"""Grouped experts: E experts' linear layers of one shape in one layer (`GroupedLinear`), held in one layout that
its method creates, and applied to rows grouped by expert (the first counts[0] rows are expert 0's, the next
counts[1] expert 1's, ...), the form an expert block's dispatch hands them over in (`group_by_expert`).

The torch references: bf16 / float weights as loaded (`DenseGroupedLinear`), and a weight format's values and
scales stacked over the experts (`QuantizedGroupedLinear` over an `ExpertFormat`: int8 per channel, int4 per group
of 64 or 32 input columns). On the CPU with the C kernels, `CpuGroupedLinear` packs each expert once into a layout
of radixgen.kernels.cpu_linear (bf16 K pairs, int8, int4) which the grouped C expert forward
(radixgen.kernels.cpu_moe, dispatched by layers.moe.experts_forward) and the fused decode step read.
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

    def load(self, layer: GroupedLinear, expert: int, row: int, loaded) -> None:
        """Rows [row, row + loaded's rows) of expert `expert`'s (out, in) weight from a checkpoint tensor (this
        rank's rows and columns of it already); a format that keeps its checkpoint's blocks collects them here."""
        layer.weight.data[expert, row:row + loaded.shape[0]].copy_(loaded)

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

    def expert(self, layer: GroupedLinear, e: int) -> QuantizedWeight:
        """Expert e's values and scales once the layer is loaded (default: quantized from its float weight)."""
        return self.quantize(layer.weight[e].detach())


class Int8Experts(ExpertFormat):
    """int8 per output channel, as the dense layers' int8 (w = scale * q, scale = max |row| / 127)."""

    name = "int8"

    def quantize(self, w):
        return QuantizedWeight.int8_from(w)


INT8_EXPERTS = Int8Experts()


class Int4Experts(ExpertFormat):
    """int4 per group of 64 input columns (or 32), asymmetric, fp16 scale and offset: QuantizedWeight.int4_from,
    what quantization="int4" makes of the dense layers too."""

    name = "int4"

    def quantize(self, w):
        return QuantizedWeight.int4_from(w)


INT4_EXPERTS = Int4Experts()


class QuantizedGroupedLinear(GroupedLinearMethod):
    """A format's values and scales of every expert stacked: q (E, out, in), scales and offsets (E, out, groups);
    each expert with rows dequantized to x's dtype at the call and applied by F.linear (the reference)."""

    def __init__(self, fmt: ExpertFormat) -> None:
        self.fmt = fmt
        self.name = f"{fmt.name} (grouped, torch)"

    def process_weights(self, layer):
        parts = [self.fmt.expert(layer, e) for e in range(layer.num_experts)]
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


class CpuGroupedLinear(GroupedLinearMethod):
    """Each expert packed once into a layout of the C matmuls (fmt None: bf16 K pairs of the weight as loaded; else
    the format's values): `layer.packed`, a cpu_moe.PackedExperts. apply: one C matmul per expert with rows; the
    expert block's whole forward is one C call (layers.moe.experts_forward dispatches to cpu_moe)."""

    def __init__(self, kl, fmt: ExpertFormat | None = None) -> None:
        self.kl, self.fmt = kl, fmt
        self.name = f"{'bf16 K pairs' if fmt is None else fmt.name} (grouped, C)"

    def process_weights(self, layer):
        from radixgen.kernels import cpu_linear, cpu_moe

        packed = [cpu_linear.pack_bf16(layer.weight[e].detach()) if self.fmt is None else
                  self.fmt.expert(layer, e).pack() for e in range(layer.num_experts)]
        layer.weight = None
        layer.packed = cpu_moe.PackedExperts(packed)

    def apply(self, layer, x, counts):
        from radixgen.kernels import cpu_linear

        out = x.new_empty((x.shape[0], layer.out_features))
        for e, s, t in _groups(x, counts):
            out[s:t] = cpu_linear._linear(self.kl, layer.packed.weights[e], x[s:t].contiguous(), None)
        return out

    def dequantize(self, layer, expert):
        from radixgen.kernels import cpu_linear

        return cpu_linear.unpack(layer.packed.weights[expert])

    def nbytes(self, layer):
        return layer.packed.nbytes + super().nbytes(layer)


DENSE_GROUPED = DenseGroupedLinear()
_FORMATS = {"int8": INT8_EXPERTS, "int4": INT4_EXPERTS}


def grouped_method(quantization: str, ops: str = "torch", kl=None, layer: GroupedLinear | None = None
                   ) -> GroupedLinearMethod:
    """The grouped-expert method of weight format `quantization` (a QuantSpec's method name, or "int4" for experts
    quantized at load) under the ops set named `ops` (kl: its C kernels, or None): the C one on the CPU where the
    kernels take it (quantized experts; bf16 ones on AVX512-BF16 builds: float32 keeps its exact torch reference),
    else the torch reference. A layer whose checkpoint stores blocks of a GGUF kind (`layer.stored_blocks`, set by
    its model: gpt-oss's MXFP4) takes the GGUF method on the C kernels, its loader handing the blocks over."""
    if quantization == "none" and ops == "cpu" and kl is not None and getattr(layer, "stored_blocks", None):
        quantization = "gguf"  # a checkpoint's own blocks (gpt-oss's MXFP4), handed over as GGUF stacks
    if quantization == "gguf":  # the file's blocks, as they are where a kernel takes them (layers/quantization/gguf)
        from radixgen.runtime.layers.quantization.gguf import GGUFGroupedLinear

        return GGUFGroupedLinear(ops, kl if ops == "cpu" else None)
    if quantization != "none" and quantization not in _FORMATS:
        raise ValueError(f"quantization {quantization!r} has no grouped-expert form yet (supported for experts: "
                         f"none, {', '.join(_FORMATS)}, gguf)")
    fmt = _FORMATS.get(quantization)
    if fmt is INT4_EXPERTS and ops == "triton":
        raise ValueError("int4 experts run on the CPU (the C int4 kernels); CUDA has no int4 expert kernel")
    if ops == "cpu" and kl is not None and layer is not None and _c_takes(layer, fmt, kl):
        return CpuGroupedLinear(kl, fmt)
    return DENSE_GROUPED if fmt is None else QuantizedGroupedLinear(fmt)


def _c_takes(layer: GroupedLinear, fmt: ExpertFormat | None, kl) -> bool:
    """Whether the C layouts hold `layer`'s experts: bf16 K pairs need an even input size (and bf16 weights on a
    build with AVX512-BF16), int8 a multiple of 16, int4 of 32."""
    k = layer.in_features
    if fmt is None:
        return layer.dtype == torch.bfloat16 and kl.has_decode_step and k % 2 == 0
    return k % (16 if fmt is INT8_EXPERTS else 32) == 0


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


def convert(layer: GroupedLinear, method: GroupedLinearMethod) -> None:
    """Lay a loaded layer's experts out again in `method`'s layout, from its current ones dequantized to the layer's
    dtype: a bf16 checkpoint's experts quantized after loading (the benchmark's int4 experts, tests)."""
    w = torch.stack([layer.method.dequantize(layer, e) for e in range(layer.num_experts)]).to(layer.dtype)
    for name in ("q", "scales", "offsets"):
        layer._buffers.pop(name, None)
    layer.__dict__.pop("packed", None)
    layer.weight = nn.Parameter(w, requires_grad=False)
    layer.method = method
    method.process_weights(layer)
