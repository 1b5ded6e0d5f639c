"""GGUF weights executed from their own blocks (quantization="gguf", and auto on the CPU): on builds with the fused
decode step (AVX512-BF16) Q4_0 and Q4_1 as int4, Q8_0 and Q6_K as int8, the blocks' exact values and scales repacked
into the C kernels' layouts at load (the layouts the step reads); elsewhere (AVX2) all four on the block kernels of
kernels/cpu_gguf.py from the file's bytes as stored (BLOCK_NATIVE); Q4_K and Q5_K on kernels
of their own (kernels/cpu_gguf.py, layers in gguf_k.py), their 4 / 5-bit codes and 6-bit sub-block scales read as
stored, and Q6_K parts of such layers from their 6.56 bits. Q5_0, Q3_K, IQ4_NL, IQ4_XS and MXFP4 run as int8
where their values are exactly that (gguf_int8, a log line per type). Other types are dequantized (with a log
line) to the model's dtype; float tensors stay float; a type the gguf package cannot dequantize either is an error
naming the tensor.

Blocks (per row of K values, K / block_size blocks; fp16 scales):
  Q4_0  32 values in 18 bytes: d, then 16 bytes: value j in the low nibble of byte j, value j + 16 in its high
        nibble; w = d (q - 8)                       -> int4 with zero point 8, scale d, group 32
  Q4_1  32 values in 20 bytes: d, m, the same nibbles; w = d q + m   -> int4, scale d, offset m, group 32
  Q8_0  32 values in 34 bytes: d, 32 int8; w = d q                 -> int8, scale d, group 32
  Q6_K  256 values in 210 bytes: ql (128 bytes, low 4 bits), qh (64 bytes, high 2 bits), 16 int8 sub-block
        scales, d; value e has scale d * scales[e / 16] and 6-bit q with w = scale (q - 32): in each half h of
        128 values, l < 32: value l takes ql[l] low nibble and qh[l] bits 0-1, value l + 32 ql[l + 32] low and
        qh[l] bits 2-3, value l + 64 ql[l] high and bits 4-5, value l + 96 ql[l + 32] high and bits 6-7 (ql, qh
        offset by 64 h and 32 h)                   -> int8 (q - 32), scale d * scales[e / 16], group 16
A merged layer (qkv, gate|up) with a K-quant part runs each part in its own kind (GGUFPartsLinear: Q4_K_M's Q4_K
q and k beside a Q6_K v); one whose parts differ in kind otherwise is dequantized as a whole. An expert block's stacks
(ffn_{gate,up,down}_exps, one type per stack) the same way per expert (`GGUFGroupedLinear`): the experts' exact
values in the grouped C layouts (cpu_moe) for the four native types, from their own blocks one expert at a time
on the per-linear kernels for the kinds those have (MXFP4, K-quants, ...: gguf_experts), else all dequantized.

Longer than 400 lines: the method that picks a layer's kernel per tensor kind, and the merged-layer and expert
forms that share its choices; the kinds' own code lives in gguf_k, gguf_more, gguf_int8 and gguf_experts.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from radixgen.runtime.layers.linear import LinearMethod, MergedColumnParallelLinear, QKVParallelLinear, new_param
from radixgen.runtime.layers.quantization import gguf_more, unquantized
from radixgen.runtime.layers.quantization.base import CpuPackedLinear, Format, QuantizedWeight, TorchQuantizedLinear
from radixgen.runtime.layers.quantization.gguf_int8 import int8_exact
from radixgen.runtime.layers.quantization.gguf_k import GGUFPartsLinear, runs_alone

logger = logging.getLogger(__name__)

NATIVE = ("Q4_0", "Q4_1", "Q8_0", "Q6_K")
# layers with a part of these types run on the K-quant kernels (kernels/cpu_gguf.py), every part in its own kind (a
# Q6_K part there too, at its 6.56 bits); a layer of Q6_K alone keeps int8, the layout of the fused decode step (and
# of cpu_linear's prefill GEMM: 4.6x the K-quant tile's speed at 512 rows, so it stays int8 in a Q4_K_M model too)
K_NATIVE = ("Q4_K", "Q5_K")
# on builds without the fused decode step (no AVX512-BF16: nothing reads cpu_linear's layouts in one call), these run
# from the file's blocks on the kernels of kernels/cpu_gguf.py too (int8 inputs, integer dot products), every part in
# its own kind: a layer of Q6_K alone at its 6.56 bits, Q4_0 / Q4_1 / Q8_0 as stored
BLOCK_NATIVE = ("Q4_0", "Q4_1", "Q8_0", "Q6_K")
FLOAT = ("F32", "F16", "BF16")


class GGUFError(ValueError):
    """A GGUF tensor radixgen can neither execute nor dequantize."""


@dataclass(eq=False)
class GGUFTensor:
    """One GGUF tensor as stored: `raw` (rows, bytes per row) uint8 for block types, or the float values (rows,
    columns) for float types; rows are output features, `columns` input features."""

    name: str
    type_name: str
    raw: torch.Tensor
    columns: int

    @property
    def rows(self) -> int:
        return self.raw.shape[0]

    @property
    def shape(self) -> tuple[int, int]:
        return self.rows, self.columns

    def narrow(self, dim: int, start: int, length: int) -> GGUFTensor:
        """Output rows (dim 0) or input columns (dim 1, whole blocks) [start, start + length): a tensor-parallel
        rank's part, as a checkpoint tensor's narrow."""
        if dim == 0:
            return GGUFTensor(self.name, self.type_name, self.raw.narrow(0, start, length), self.columns)
        per_block, block_bytes = self.block()
        if start % per_block or length % per_block:
            raise ValueError(f"GGUF tensor {self.name!r} ({self.type_name}): input columns [{start}, {start + length})"
                             f" do not fall on its blocks of {per_block} values, so tensor parallelism cannot split "
                             f"it there")
        return GGUFTensor(self.name, self.type_name,
                          self.raw.narrow(1, start // per_block * block_bytes, length // per_block * block_bytes),
                          length)

    def block(self) -> tuple[int, int]:
        """(values, elements of `raw`) per block along a row: (1, 1) for float types."""
        if self.type_name in FLOAT:
            return 1, 1
        import gguf

        try:
            return gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[self.type_name]]
        except KeyError:
            raise GGUFError(f"GGUF tensor {self.name!r} has type {self.type_name}, which radixgen does not "
                            f"know") from None

    def padded(self, rows: int) -> GGUFTensor:
        """`rows` rows, the ones past its own zero (zero blocks dequantize to zero in every type: their scales
        are 0): an LM head's padding past the vocabulary."""
        pad = self.raw.new_zeros((rows - self.rows, self.raw.shape[1]))
        return GGUFTensor(self.name, self.type_name, torch.cat([self.raw, pad]), self.columns)

    def quantized(self) -> QuantizedWeight | None:
        """The blocks' exact values and scales (as int8 for the types of gguf_int8 whose values are exactly that), or
        None for a type without a native kernel."""
        decode = _DECODERS.get(self.type_name)
        return int8_exact(self) if decode is None else decode(self.raw, self.rows, self.columns)

    def dense(self) -> torch.Tensor:
        """The (rows, columns) float32 weight (the gguf package's dequantization for block types)."""
        if self.type_name in FLOAT:
            return self.raw.float()
        fast = _c_dense(self)
        if fast is not None:
            return fast
        import gguf

        try:
            data = gguf.quants.dequantize(self.raw.numpy(), gguf.GGMLQuantizationType[self.type_name])
        except (NotImplementedError, KeyError, ValueError) as e:
            raise GGUFError(f"GGUF tensor {self.name!r} has type {self.type_name}, which radixgen can neither run "
                            f"nor dequantize ({e})") from e
        return torch.from_numpy(data.copy()).float().reshape(self.rows, self.columns)


# the kinds whose C row readers give the gguf package's dequantization bit for bit (tests/runtime/test_gguf_experts.py)
C_DENSE = ("Q8_0", "Q4_0", "Q4_1", "Q4_K", "Q5_K", "Q6_K", "Q5_0", "Q5_1", "Q2_K", "Q3_K", "IQ4_XS", "MXFP4")


def _c_dense(t: GGUFTensor) -> torch.Tensor | None:
    """t's float32 values from the C kernels' row readers (an untied 201k-row embedding: a second, where the gguf
    package's numpy takes half a minute), or None where they do not read its kind."""
    from radixgen.kernels import cpu, cpu_gguf, cpu_gguf_more

    if t.type_name not in C_DENSE or not cpu.available():
        return None
    qk = cpu_gguf_more.QK.get(t.type_name) or cpu_gguf.BLOCK_VALUES[t.type_name]
    if t.columns % qk or t.raw.dtype != torch.uint8 or t.raw.dim() != 2:
        return None
    w = cpu_gguf_more.wrap(t.raw, t.type_name, t.columns) if t.type_name in cpu_gguf_more.KINDS \
        else cpu_gguf.repack(t.raw.contiguous(), t.type_name, t.columns)
    return cpu_gguf._rows(cpu.lib(), w, torch.arange(t.rows), torch.float32)


@dataclass(eq=False)
class GGUFStack:
    """An expert block's GGUF tensor as stored: `raw` (E, rows, bytes per row) uint8 (or float values), one
    GGUFTensor per expert (iteration); `narrow` on dim 0 takes experts, as a stacked checkpoint tensor's."""

    name: str
    type_name: str
    raw: torch.Tensor
    columns: int

    @property
    def shape(self) -> tuple[int, int, int]:
        return self.raw.shape[0], self.raw.shape[1], self.columns

    def narrow(self, dim: int, start: int, length: int) -> GGUFStack:
        if dim != 0:
            raise ValueError(f"GGUF expert stack {self.name!r}: only whole experts can be taken")
        return GGUFStack(self.name, self.type_name, self.raw.narrow(0, start, length), self.columns)

    def __len__(self) -> int:
        return self.raw.shape[0]

    def __iter__(self):
        for e in range(len(self)):
            yield GGUFTensor(f"{self.name}[{e}]", self.type_name, self.raw[e], self.columns)

    def dense(self) -> torch.Tensor:
        return torch.stack([t.dense() for t in self])


def _blocks(raw: torch.Tensor, n: int, block_bytes: int) -> torch.Tensor:
    return raw.reshape(n, -1, block_bytes)


def _f16(b: torch.Tensor, lo: int) -> torch.Tensor:
    """The fp16 at bytes [lo, lo + 2) of every block, as float32 (n, blocks)."""
    return b[..., lo:lo + 2].contiguous().view(torch.float16)[..., 0].float()


def _nibbles16(qs: torch.Tensor) -> torch.Tensor:
    """(n, blocks, 16) bytes -> (n, blocks, 32) values: low nibbles first, then high nibbles."""
    return torch.cat([qs & 15, qs >> 4], -1)


def _q4_0(raw, n, k):
    b = _blocks(raw, n, 18)
    return QuantizedWeight(4, _nibbles16(b[..., 2:]).reshape(n, k), _f16(b, 0), 32,
                           torch.full((n, k // 32), 8.0), zero_points=True)


def _q4_1(raw, n, k):
    b = _blocks(raw, n, 20)
    return QuantizedWeight(4, _nibbles16(b[..., 4:]).reshape(n, k), _f16(b, 0), 32, _f16(b, 2))


def _q8_0(raw, n, k):
    b = _blocks(raw, n, 34)
    return QuantizedWeight(8, b[..., 2:].contiguous().view(torch.int8).reshape(n, k), _f16(b, 0), 32)


def _q6_k(raw, n, k):
    from radixgen.kernels.cpu import lib

    kl = lib()
    if kl is not None:  # in C, rows in parallel: the torch below took ~1 s per 2048 x 8192 weight
        src = raw.contiguous()
        q, s = torch.empty((n, k), dtype=torch.int8), torch.empty((n, k // 16), dtype=torch.float32)
        kl.fn("rg_gguf_q6k_int8")(raw=src.data_ptr(), N=n, K=k, q=q.data_ptr(), s=s.data_ptr())
        return QuantizedWeight(8, q, s, 16)
    b = _blocks(raw, n, 210)
    ql, qh = b[..., :128], b[..., 128:192]
    halves = []
    for h in range(2):
        lo, hi = ql[..., 64 * h:64 * h + 64], qh[..., 32 * h:32 * h + 32]
        halves += [(lo[..., :32] & 15) | ((hi & 3) << 4), (lo[..., 32:] & 15) | (((hi >> 2) & 3) << 4),
                   (lo[..., :32] >> 4) | (((hi >> 4) & 3) << 4), (lo[..., 32:] >> 4) | (((hi >> 6) & 3) << 4)]
    q = (torch.cat(halves, -1).to(torch.int16) - 32).to(torch.int8).reshape(n, k)
    sub = b[..., 192:208].contiguous().view(torch.int8).float()  # (n, blocks, 16)
    return QuantizedWeight(8, q, (_f16(b, 208)[..., None] * sub).reshape(n, k // 16), 16)


_DECODERS = {"Q4_0": _q4_0, "Q4_1": _q4_1, "Q8_0": _q8_0, "Q6_K": _q6_k}


class Decoded(Format):
    """A format whose values were decoded from GGUF blocks already."""

    def __init__(self, qw: QuantizedWeight, name: str) -> None:
        self.qw, self.name = qw, name

    def quantized(self, layer):
        return self.qw

    def drop(self, layer):
        self.qw = None  # the method holds its own layout now


def _part_order(layer) -> list:
    if isinstance(layer, QKVParallelLinear):
        return ["q", "k", "v"]
    if isinstance(layer, MergedColumnParallelLinear):
        return list(range(len(layer.out_sizes)))
    return [None]


class GGUFLinear(LinearMethod):
    """Collects a layer's GGUF tensors (one per merged part) while loading, then hands the layer to the method of
    what they hold: the C int4 / int8 kernels (TorchOps: the torch reference) for the native types, the float
    method for the rest (dequantized)."""

    name = "gguf"

    def __init__(self, ops: str, kl) -> None:
        self.ops, self.kl = ops, kl

    def create_weights(self, layer):
        parts: dict = {}

        def collect(param, loaded, shard_id=None):
            if not isinstance(loaded, GGUFTensor):
                raise ValueError(f"expected a GGUF tensor, got {type(loaded).__name__}")
            parts[shard_id] = layer.checkpoint_part(param, loaded, shard_id)  # this rank's rows and columns

        layer.weight = new_param((0,), None, collect, 0, 1)  # what the loader addresses
        layer.gguf_parts = parts

    def process_weights(self, layer):
        parts = [layer.gguf_parts[s] for s in _part_order(layer)]
        del layer.gguf_parts
        if len(parts) == 1 and parts[0].rows < layer.out_features:  # a vocabulary shard's padding rows
            parts = [parts[0].padded(layer.out_features)]
        names = ", ".join(f"{p.name} ({p.type_name})" for p in parts)
        if self.kl is not None and gguf_more.takes(parts, layer.in_features):  # Q5_0, Q2_K, IQ4_XS, MXFP4, ...
            final = gguf_more.GGUFBlocksLinear(self.kl, parts)
            layer.weight, layer.method = None, final
            final.process_weights(layer)
            return
        k_quant = any(p.type_name in K_NATIVE for p in parts)
        blocks = self.kl is not None and not self.kl.has_decode_step and all(p.type_name in BLOCK_NATIVE for p in parts)
        if self.kl is not None and (k_quant or blocks) and all(runs_alone(p, layer.in_features) for p in parts):
            final = GGUFPartsLinear(self.kl, parts)  # K-quants from their own bits, each part in its own kind
            layer.weight, layer.method = None, final
            final.process_weights(layer)
            return
        decoded = [p.quantized() for p in parts]
        qw = None if any(d is None for d in decoded) else QuantizedWeight.cat(decoded)
        if qw is not None and (qw.group % (16 if qw.bits == 8 else 32) or layer.in_features % qw.group):
            qw = None
        if qw is None:
            if any(p.type_name not in FLOAT for p in parts):
                logger.info("GGUF %s: no native kernel, dequantized to %s", names, layer.dtype)
            dense = torch.cat([p.dense() for p in parts]).to(layer.dtype)
            layer.weight = torch.nn.Parameter(dense, requires_grad=False)
            final = unquantized.method(self.ops, layer, self.kl)
        else:
            layer.weight = None
            fmt = Decoded(qw, f"gguf {'/'.join(sorted({p.type_name for p in parts}))}")
            final = CpuPackedLinear(self.kl, fmt) if self.kl is not None else TorchQuantizedLinear(fmt)
        layer.method = final
        final.process_weights(layer)


def method(ops: str, spec, layer, kl):
    if ops == "triton":
        raise ValueError("quantization=gguf runs on the CPU (its kernels are the C ones); on CUDA load the .gguf "
                         "file with quantization auto (dequantized)")
    return GGUFLinear(ops, kl if ops == "cpu" else None)


class DecodedExperts:
    """The experts' values decoded from their GGUF blocks (an experts.ExpertFormat: `expert(layer, e)`)."""

    def __init__(self, parts: list[QuantizedWeight], name: str) -> None:
        self.parts, self.name = parts, name

    def expert(self, layer, e):
        return self.parts[e]


class GGUFGroupedLinear:
    """An expert block's GroupedLinear from GGUF stacks (an experts.GroupedLinearMethod): `load` collects each
    expert's blocks (gate and up rows apart), `process_weights` hands the layer to the grouped method of what
    they hold: the grouped C kernels over the exact values (TorchOps: the torch reference) where every expert's
    gate_up (and down) is of one native kind, else the dense experts of the model's dtype, dequantized."""

    name = "gguf (grouped)"

    def __init__(self, ops: str, kl) -> None:
        if ops == "triton":
            raise ValueError("quantization=gguf runs on the CPU (its kernels are the C ones); on CUDA load the .gguf "
                             "file with quantization auto (dequantized)")
        self.ops, self.kl = ops, kl

    def create_weights(self, layer):
        loader = layer.weight.weight_loader
        layer.weight = torch.nn.Parameter(torch.empty(0), requires_grad=False)  # what the loader addresses
        layer.weight.weight_loader = loader
        layer.gguf_parts = {}

    def load(self, layer, expert, row, loaded):
        if not isinstance(loaded, GGUFTensor):
            raise ValueError(f"expected a GGUF expert stack, got {type(loaded).__name__}")
        layer.gguf_parts[(expert, row)] = loaded

    def process_weights(self, layer):
        from radixgen.runtime.layers.quantization.experts import (
            CpuGroupedLinear,
            QuantizedGroupedLinear,
            grouped_method,
        )

        collected = layer.gguf_parts
        del layer.gguf_parts
        experts = [[collected[key] for key in sorted(k for k in collected if k[0] == e)]
                   for e in range(layer.num_experts)]
        for e, parts in enumerate(experts):
            if sum(p.rows for p in parts) != layer.out_features:
                raise ValueError(f"expert {e} of a GGUF expert block has {sum(p.rows for p in parts)} of its "
                                 f"{layer.out_features} rows")
        names = ", ".join(dict.fromkeys(f"{p.name.split('[')[0]} ({p.type_name})" for p in experts[0]))
        from radixgen.runtime.layers.quantization import gguf_experts

        if gguf_experts.takes(experts, self.kl):  # MXFP4, K-quants, ...: per expert from the file's blocks
            final = gguf_experts.GGUFBlocksGroupedLinear(self.kl, experts)
            layer.weight, layer.method = None, final
            final.process_weights(layer)
            return
        decoded = []
        for parts in experts:
            qws = [p.quantized() for p in parts]
            decoded.append(None if any(q is None for q in qws) else QuantizedWeight.cat(qws))
        first = decoded[0]
        native = first is not None and all(
            d is not None and (d.bits, d.group, d.zero_points) == (first.bits, first.group, first.zero_points)
            for d in decoded) and first.group % (16 if first.bits == 8 else 32) == 0 \
            and layer.in_features % first.group == 0
        if native:
            layer.weight = None
            fmt = DecodedExperts(decoded, f"gguf {'/'.join(sorted({p.type_name for p in experts[0]}))}")
            final = CpuGroupedLinear(self.kl, fmt) if self.kl is not None else QuantizedGroupedLinear(fmt)
        else:
            if any(p.type_name not in FLOAT for p in experts[0]):
                logger.info("GGUF experts %s: no native kernel for them together, dequantized to %s", names,
                            layer.dtype)
            dense = torch.stack([torch.cat([p.dense() for p in parts]) for parts in experts]).to(layer.dtype)
            layer.weight = torch.nn.Parameter(dense, requires_grad=False)
            final = grouped_method("none", self.ops, self.kl, layer)
        layer.method = final
        final.process_weights(layer)
        if native:
            fmt.parts = None  # the method holds its own layout now

    def nbytes(self, layer):
        return 0
