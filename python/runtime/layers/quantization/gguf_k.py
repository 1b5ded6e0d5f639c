"""GGUF layers holding K-quant tensors (Q4_K, Q5_K), and on builds without the fused decode step every block type of
kernels/cpu_gguf.py, on the C kernels: each merged part (q, k, v; gate, up) kept
in its own kind, as the file mixes them (a Q4_K_M file has Q4_K q and k beside a Q6_K v): K-quants in the layout
of kernels/cpu_gguf.py, the other native types in cpu_linear's int8 / int4 layouts; the parts' outputs side by
side. Nothing is dequantized at load."""

from __future__ import annotations

import torch

from radixgen.kernels import cpu_gguf, cpu_linear
from radixgen.runtime.layers.linear import LinearMethod


def runs_alone(part, in_features: int) -> bool:
    """Whether a part (a gguf.GGUFTensor) has a C kernel of its own here: a K-quant, or a native type whose values
    fit the int8 / int4 layouts' groups."""
    if part.type_name in cpu_gguf.KINDS:
        return part.columns % cpu_gguf.BLOCK_VALUES[part.type_name] == 0
    qw = part.quantized()
    return qw is not None and qw.group % (16 if qw.bits == 8 else 32) == 0 and in_features % qw.group == 0


class GGUFPartsLinear(LinearMethod):
    """One C weight per run of parts of one kind (a KQuantWeight: q, k and v of one type are one matmul) or per
    part (a PackedWeight), applied in turn, outputs concatenated (+ bias)."""

    def __init__(self, kl, parts: list) -> None:
        self.kl, self.parts = kl, parts  # the GGUFTensors until process_weights
        self.name = f"gguf {'/'.join(sorted({p.type_name for p in parts}))} (C)"

    def process_weights(self, layer):
        weights, kinds = [], []
        for p in self.parts:
            if p.type_name in cpu_gguf.KINDS:
                if kinds and kinds[-1] == p.type_name:  # beside a part of its kind: one weight, one call per step
                    weights[-1][1].append(p.raw)
                else:
                    weights.append((p.type_name, [p.raw]))
            else:
                weights.append(p)
            kinds.append(p.type_name)
        weights = [cpu_gguf.repack_parts(w[1], w[0], self.parts[0].columns, kl=self.kl) if isinstance(w, tuple)
                   else w.quantized().pack() for w in weights]
        self.parts = None
        layer.gguf_weights = weights

    def _one(self, w, x2: torch.Tensor) -> torch.Tensor:
        if isinstance(w, cpu_gguf.KQuantWeight):
            return cpu_gguf._linear(self.kl, w, x2)
        return cpu_linear._linear(self.kl, w, x2, None)

    def apply(self, layer, x):
        x2 = x.reshape(-1, layer.in_features).contiguous()
        ws = layer.gguf_weights
        y = self._one(ws[0], x2) if len(ws) == 1 else torch.cat([self._one(w, x2) for w in ws], 1)
        if layer.bias is not None:
            y = y + layer.bias
        return y.view(*x.shape[:-1], layer.out_features)

    def _rows(self, w, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        if isinstance(w, cpu_gguf.KQuantWeight):
            return cpu_gguf._rows(self.kl, w, ids, dtype)
        return cpu_linear._rows(self.kl, w, ids, dtype)

    def dequantize(self, layer):
        return torch.cat([self._rows(w, torch.arange(w.n), torch.float32) for w in layer.gguf_weights])

    def embed(self, layer, ids):
        ws = layer.gguf_weights
        flat = ids.reshape(-1).to(torch.int64).contiguous()
        rows = self._rows(ws[0], flat, layer.dtype) if len(ws) == 1 else self.dequantize(layer)[flat].to(layer.dtype)
        return rows.view(*ids.shape, layer.in_features)

    def nbytes(self, layer):
        return sum(w.nbytes for w in layer.gguf_weights) + super().nbytes(layer)
