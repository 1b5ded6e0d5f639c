"""GGUF Q5_0, Q5_1, Q2_K, Q3_K, IQ4_NL, IQ4_XS and MXFP4 weights run from their own bits by the C kernels of
csrc/cpu_gguf_more.h, read exactly as the file stores them: `wrap` checks a tensor's blocks ((N, bytes per row)
uint8, a view of the memory-mapped file where it is contiguous) and keeps them as they are, so a weight costs its
file bytes and loading copies nothing.
`linear` is y = x @ w^T (+ bias) with the input quantized to int8 per 32 values inside the kernel, `rows`
dequantized rows (an embedding lookup, bit for bit the gguf package's `dequantize`): cpu_gguf's, which call the
entry points the weight names.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ._checks import check_tensor, expect
from .cpu_gguf import _linear, _rows, linear, rows  # the checked matmul and row gather of every GGUF block weight

__all__ = ["KINDS", "QK", "BLOCK_BYTES", "BlockWeight", "row_bytes", "wrap", "linear", "rows", "_linear", "_rows"]

KINDS = {"Q5_0": 0, "Q5_1": 1, "Q2_K": 2, "Q3_K": 3, "IQ4_NL": 4, "IQ4_XS": 5, "MXFP4": 6}  # RG_GM_*
QK = {"Q5_0": 32, "Q5_1": 32, "Q2_K": 256, "Q3_K": 256, "IQ4_NL": 32, "IQ4_XS": 256, "MXFP4": 32}
BLOCK_BYTES = {"Q5_0": 22, "Q5_1": 24, "Q2_K": 84, "Q3_K": 110, "IQ4_NL": 18, "IQ4_XS": 136, "MXFP4": 17}


@dataclass(eq=False)
class BlockWeight:
    """An (n, k) weight of one of KINDS as the file stores it: `data` (n, k / QK * block bytes) uint8."""

    type_name: str
    n: int
    k: int
    data: torch.Tensor
    entry = "rg_gguf_more"  # its C entry points' prefix (cpu_gguf.linear / rows call them)

    @property
    def kind(self) -> int:
        return KINDS[self.type_name]

    @property
    def nbytes(self) -> int:
        return self.data.numel()

    def __repr__(self) -> str:
        return f"BlockWeight({self.type_name}, {self.n} x {self.k}, {self.nbytes} bytes)"


def row_bytes(type_name: str, k: int) -> int:
    return k // QK[type_name] * BLOCK_BYTES[type_name]


def wrap(raw: torch.Tensor, type_name: str, k: int) -> BlockWeight:
    """raw (N, k / QK * block bytes) uint8, a tensor's blocks as stored -> a BlockWeight over the same memory (a
    copy only where raw is not contiguous)."""
    expect(type_name in KINDS, f"cpu_gguf_more takes {sorted(KINDS)}, got {type_name}")
    check_tensor("raw", raw, 2, (torch.uint8,))
    qk = QK[type_name]
    expect(k % qk == 0 and k > 0, f"a {type_name} row holds whole blocks of {qk} values, got {k}")
    expect(raw.shape[1] == row_bytes(type_name, k),
           f"{type_name} rows of {k} values take {row_bytes(type_name, k)} bytes, got {raw.shape[1]}")
    expect(raw.shape[0] > 0, f"a {type_name} weight needs at least one row")
    return BlockWeight(type_name, raw.shape[0], k, raw.contiguous())
