"""What the weight formats share: a weight's quantized values and scales in no kernel's layout (QuantizedWeight),
what a format tells the methods (`Format`: its checkpoint's parameters, the values they hold), and the two methods
that run any format's values: CpuPackedLinear (packed once for the C matmuls of radixgen.kernels.cpu_linear, also
the unquantized bf16 K-pair layout) and TorchQuantizedLinear (the plain-torch reference, TorchOps)."""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from radixgen.kernels import cpu_linear
from radixgen.runtime.ground.forward_context import in_decode_or_verify
from radixgen.runtime.layers.linear import LinearBase, LinearMethod


@dataclass(eq=False)
class QuantizedWeight:
    """An (n, k) weight as integer values and a scale per row and group of `group` input columns.
    bits 8: q int8, w = scales * q. bits 4: q uint8 in 0..15, w = scales * q + offsets, or with zero_points
    w = scales * (q - offsets). perm (k,) int64: column j of q (and its group) is input column perm[j] (GPTQ's
    activation order); None: in order. scales and offsets (n, k // group) float32."""

    bits: int
    q: torch.Tensor
    scales: torch.Tensor
    group: int
    offsets: torch.Tensor | None = None
    zero_points: bool = False
    perm: torch.Tensor | None = None

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.q.shape)

    def dequantize(self) -> torch.Tensor:
        """The dense (n, k) float32 weight, columns in input order."""
        s = self.scales.repeat_interleave(self.group, 1)
        if self.bits == 8:
            w = self.q.float() * s
        else:
            o = self.offsets.repeat_interleave(self.group, 1)
            w = s * (self.q.float() - o) if self.zero_points else s * self.q.float() + o
        if self.perm is not None:
            w = torch.empty_like(w).index_copy_(1, self.perm, w)
        return w

    def pack(self) -> cpu_linear.PackedWeight:
        if self.bits == 8:
            return cpu_linear.pack_int8(self.q, self.scales, self.group)
        return cpu_linear.pack_int4(self.q, self.scales, self.offsets, self.group, self.zero_points)

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.q, self.scales, self.offsets, self.perm)
                   if t is not None)

    @staticmethod
    def int8_from(w: torch.Tensor) -> QuantizedWeight:
        """Symmetric int8 per output channel: scale = max |w_row| / 127, q = round(w / scale)."""
        w = w.float()
        scales = (w.abs().amax(1, keepdim=True) / 127).clamp_min(torch.finfo(torch.float32).tiny)
        q = torch.round(w / scales).clamp_(-127, 127).to(torch.int8)
        return QuantizedWeight(8, q, scales, w.shape[1])

    @staticmethod
    def int4_from(w: torch.Tensor) -> QuantizedWeight:
        """Asymmetric int4 per group of 64 input columns (32 where the input size is no multiple of 64): w = scale *
        q + offset, q in 0..15, scale = (max - min) / 15 and offset = min of the group, both rounded to fp16 first
        (the C layout stores them so), q computed against the rounded ones."""
        w = w.float()
        k = w.shape[1]
        group = 64 if k % 64 == 0 else 32
        if k % group:
            raise ValueError(f"int4 needs input sizes that are a multiple of 32, got {k}")
        g = w.view(w.shape[0], k // group, group)
        lo, hi = g.amin(-1), g.amax(-1)
        scales = ((hi - lo) / 15).clamp_min(1e-6).half().float()  # (n, groups)
        offsets = lo.half().float()
        q = torch.round((g - offsets[..., None]) / scales[..., None]).clamp_(0, 15).to(torch.uint8)
        return QuantizedWeight(4, q.view_as(w), scales, group, offsets, zero_points=False)

    @staticmethod
    def cat(parts: list[QuantizedWeight]) -> QuantizedWeight | None:
        """The parts stacked along the rows (a merged layer's projections), or None where they are not of one
        kind (bits, group, offsets' meaning, column order)."""
        first = parts[0]
        if any((p.bits, p.group, p.zero_points, p.perm is None) != (first.bits, first.group, first.zero_points, True)
               for p in parts):
            return None
        offsets = None if first.offsets is None else torch.cat([p.offsets for p in parts])
        return QuantizedWeight(first.bits, torch.cat([p.q for p in parts]), torch.cat([p.scales for p in parts]),
                               first.group, offsets, first.zero_points)


def split_note(layer: LinearBase) -> str:
    """What an error about `layer`'s sizes adds under tensor parallelism (the sizes are the rank's share)."""
    tp = layer.tp.size
    return f" (this rank's share of the layer at tp_size={tp})" if tp > 1 else ""


class Format:
    """A weight format as the methods see it: the parameters its checkpoint loads into and the values they hold.
    The default is a float checkpoint's dense weight."""

    name = "?"

    def create_weights(self, layer: LinearBase) -> None:
        """Before loading: replace the layer's dense weight by the checkpoint's parameters (default: keep it)."""

    def quantized(self, layer: LinearBase) -> QuantizedWeight:
        """After loading: the layer's values and scales."""
        raise NotImplementedError

    def drop(self, layer: LinearBase) -> None:
        """Remove the checkpoint's parameters (the method keeps its own layout)."""
        layer.weight = None


class CheckpointLinear(LinearMethod):
    """A method over a format's checkpoint tensors as loaded (the CUDA kernels read them so); subclasses apply."""

    def __init__(self, fmt: Format) -> None:
        self.fmt = fmt

    def create_weights(self, layer):
        self.fmt.create_weights(layer)

    def dequantize(self, layer):
        return self.fmt.quantized(layer).dequantize()


# Prefill matmuls of at least AMX_MIN_ROWS rows run on the AMX tile GEMM (csrc/cpu_linear_amx.h) where the build and
# process have it: it reads every layout in place (int8 / int4 blocks dequantized to bf16 per pair of blocks) and was
# 1.2-1.8x the C kernels at 8 rows, 2.4-3.6x at 16, 5-9x from 64 (bf16; int8 and int4 1.1-1.9x at 8), and faster than
# oneDNN over a copy of the weight at every shape and row count measured but one (within 5%)
# (benchmarks/bench_linear.py: SmolLM2-135M and Qwen2-0.5B shapes, 1 to 1024 rows, 2 threads of a Xeon); under 8 rows
# the C streaming kernels are as fast or faster. Where the AMX GEMM is missing (another build, the OS refusing the
# tile state, an input size that is no multiple of 32), bf16 K-pair matmuls of ONEDNN_MIN_ROWS or more run on oneDNN
# if it has AMX tiles, over the weight copied out of the K-pair layout (one pass over it), which pays from about 48
# rows up. Neither runs in decode steps and verifications of draft tokens: those keep the C kernels at any row count,
# so that speculation's greedy tokens stay those of plain decoding (a verified row has the bits of the row decoded
# alone).
AMX_MIN_ROWS = 8
ONEDNN_MIN_ROWS = 64


@functools.cache
def onednn_has_amx() -> bool:
    """Whether torch's oneDNN runs bf16 matmuls on AMX tiles here: the CPU has them and ONEDNN_MAX_CPU_ISA (how the
    tests emulate older CPUs) does not hold oneDNN below them."""
    cap = os.environ.get("ONEDNN_MAX_CPU_ISA", "").upper()
    if cap and cap != "ALL" and "AMX" not in cap:
        return False
    try:
        with open("/proc/cpuinfo") as f:
            return "amx_bf16" in f.read().split()
    except OSError:
        return False


def _rows_2d(layer: LinearBase, x: torch.Tensor) -> torch.Tensor:
    return x.reshape(-1, layer.in_features)


class CpuPackedLinear(LinearMethod):
    """The weight packed once into a layout of csrc/cpu_linear.h, applied by its C matmul: bf16 K pairs (fmt None:
    the dense weight as loaded) or a format's int8 / int4 values. The fused CPU decode step reads the same layout.
    GPTQ's activation order (a column permutation) is applied to x first; such layers stay out of the fused step."""

    def __init__(self, kl, fmt: Format | None) -> None:
        self.kl, self.fmt = kl, fmt
        self.name = "bf16 K pairs (C)" if fmt is None else f"{fmt.name} (C)"
        # prefill matmuls of this many rows or more on the AMX GEMM (set once the layer is packed), else (bf16 K
        # pairs) on oneDNN's AMX tiles; 0: never. The deterministic mode's fixed summation order and the emulated
        # builds of other CPUs keep every row count on the C kernels.
        self.amx_rows = 0
        self.onednn_rows = ONEDNN_MIN_ROWS if fmt is None and kl.isa == "native" and onednn_has_amx() else 0

    def create_weights(self, layer):
        if self.fmt is not None:
            self.fmt.create_weights(layer)

    def process_weights(self, layer):
        if self.fmt is None:
            layer.packed, layer.perm = cpu_linear.pack_bf16(layer.weight.detach()), None
            layer.weight = None
        else:
            qw = self.fmt.quantized(layer)
            self.fmt.drop(layer)
            layer.packed, layer.perm = qw.pack(), qw.perm
        self.amx_rows = AMX_MIN_ROWS if cpu_linear.amx_covers(self.kl, layer.packed) else 0

    def apply(self, layer, x):
        x2 = _rows_2d(layer, x)
        if layer.perm is not None:
            x2 = x2.index_select(1, layer.perm)
        m, shape = x2.shape[0], (*x.shape[:-1], layer.out_features)
        if x2.dtype == torch.bfloat16 and (self.amx_rows or self.onednn_rows) and not in_decode_or_verify():
            if 0 < self.amx_rows <= m:
                return cpu_linear._linear(self.kl, layer.packed, x2.contiguous(), layer.bias, amx=True).view(shape)
            if not self.amx_rows and 0 < self.onednn_rows <= m:  # the AMX GEMM covers the layer: oneDNN never
                return F.linear(x2, cpu_linear.dense_bf16(layer.packed), layer.bias).view(shape)
        return cpu_linear._linear(self.kl, layer.packed, x2.contiguous(), layer.bias).view(shape)

    def dequantize(self, layer):
        w = cpu_linear._rows(self.kl, layer.packed, torch.arange(layer.out_features), torch.float32)
        return w if layer.perm is None else torch.empty_like(w).index_copy_(1, layer.perm, w)

    def embed(self, layer, ids):
        return cpu_linear._rows(self.kl, layer.packed, ids.reshape(-1).to(torch.int64).contiguous(),
                                layer.dtype).view(*ids.shape, layer.in_features)

    def nbytes(self, layer):
        return layer.packed.nbytes + super().nbytes(layer)

    def packed_weight(self, layer):
        return layer.packed if layer.perm is None else None


class TorchQuantizedLinear(LinearMethod):
    """The reference: the format's QuantizedWeight kept as it is, dequantized to x's dtype at every call and applied
    by F.linear (TorchOps; also where the C kernels are unavailable)."""

    def __init__(self, fmt: Format) -> None:
        self.fmt = fmt
        self.name = f"{fmt.name} (torch)"

    def create_weights(self, layer):
        self.fmt.create_weights(layer)

    def process_weights(self, layer):
        layer.quantized = self.fmt.quantized(layer)
        self.fmt.drop(layer)

    def apply(self, layer, x):
        return F.linear(x, layer.quantized.dequantize().to(x.dtype), layer.bias)

    def dequantize(self, layer):
        return layer.quantized.dequantize()

    def nbytes(self, layer):
        return layer.quantized.nbytes() + super().nbytes(layer)
