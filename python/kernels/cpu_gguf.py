"""GGUF K-quant weights (Q4_K, Q5_K, Q6_K) and 32-value blocks (Q4_0, Q4_1, Q8_0) run from their own bits by the C
kernels of csrc/cpu_gguf_k.h and csrc/cpu_gguf_q.h.

`repack` turns a tensor's blocks as the file stores them ((N, bytes per row) uint8) into the kernels' row-major
layout, in C (rows in parallel; in torch without the kernels), `repack_parts` several parts straight into one
weight: the packed 6-bit sub-block scales and mins spread to a byte each,
everything else as it is (148 bytes per 256 values for Q4_K against the file's 144, 180 against 176 for Q5_K);
Q6_K's blocks stay exactly as stored (210 bytes: 6.56 bits a weight), as do Q4_0's, Q4_1's and Q8_0's (18 / 20 /
34 bytes per 32 values).
`linear` is y = x @ w^T (+ bias) with the input quantized to int8 inside the kernel (per 256 values for the
K-quants, whose block products then sum in int32; per 32 for the 32-value kinds), `rows`
dequantized rows (an embedding lookup); `unpack` is the torch reference of the layout (the dense float32 weight),
`linear_ref` the reference of the matmul (float32 x against it).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ._checks import check_tensor, expect
from ._cpu_bindings import CKernels

QK = 256
KINDS = {"Q4_K": 0, "Q5_K": 1, "Q6_K": 2, "Q4_0": 3, "Q4_1": 4, "Q8_0": 5}  # csrc's RG_GK_*
BLOCK_VALUES = {"Q4_K": 256, "Q5_K": 256, "Q6_K": 256, "Q4_0": 32, "Q4_1": 32, "Q8_0": 32}
FILE_BYTES = {"Q4_K": 144, "Q5_K": 176, "Q6_K": 210, "Q4_0": 18, "Q4_1": 20, "Q8_0": 34}  # a block in the file
BLOCK_BYTES = {"Q4_K": 148, "Q5_K": 180, "Q6_K": 210, "Q4_0": 18, "Q4_1": 20, "Q8_0": 34}  # ... in the kernels'
AS_STORED = ("Q6_K", "Q4_0", "Q4_1", "Q8_0")
PANEL_GEMM_ROWS = 9  # csrc's GQ_GEMM_MIN_M: from this many rows a 32-value kind runs the panel GEMM (float32 inputs)


@dataclass(eq=False)
class KQuantWeight:
    """An (n, k) weight of one of KINDS in the layout of csrc/cpu_gguf_k.h: `data` (n, k / block values * block
    bytes) uint8."""

    type_name: str
    n: int
    k: int
    data: torch.Tensor
    entry = "rg_gguf_k"  # the C entry points' prefix: <entry>_linear, <entry>_rows (linear / rows below)

    @property
    def kind(self) -> int:
        return KINDS[self.type_name]

    @property
    def nbytes(self) -> int:
        return self.data.numel()

    def __repr__(self) -> str:
        return f"KQuantWeight({self.type_name}, {self.n} x {self.k}, {self.nbytes} bytes)"


def _scales_mins(s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The file's 12 bytes per super-block (..., 12) -> 8 sub-block scales and 8 mins (..., 8) each, 6 bits: for
    j < 4 the low 6 bits of bytes j and j + 4; for j >= 4 a nibble of byte j + 4 with the top 2 bits of byte j - 4
    (scale) or j (min) above it."""
    lo, mid, hi = s[..., 0:4], s[..., 4:8], s[..., 8:12]
    sc = torch.cat([lo & 63, (hi & 15) | ((lo >> 6) << 4)], -1)
    mn = torch.cat([mid & 63, (hi >> 4) | ((mid >> 6) << 4)], -1)
    return sc, mn


def repack(raw: torch.Tensor, type_name: str, k: int, *, kl: CKernels | None = None) -> KQuantWeight:
    """raw (N, k / 256 * file bytes) uint8, a tensor's blocks as stored -> the kernels' layout (in C, rows in
    parallel, where the kernels load: torch's byte ops took most of a 1.7B model's load; else in torch)."""
    expect(type_name in KINDS, f"repack takes {sorted(KINDS)}, got {type_name}")
    check_tensor("raw", raw, 2, (torch.uint8,))
    qk = BLOCK_VALUES[type_name]
    expect(k % qk == 0 and k > 0, f"a {type_name} row holds whole blocks of {qk} values, got {k}")
    n, nb = raw.shape[0], k // qk
    expect(raw.shape[1] == nb * FILE_BYTES[type_name],
           f"{type_name} rows of {k} values take {nb * FILE_BYTES[type_name]} bytes, got {raw.shape[1]}")
    if type_name in AS_STORED:  # read as stored
        return KQuantWeight(type_name, n, k, raw.contiguous())
    if kl is None:
        from .cpu import lib

        kl = lib()
    if kl is not None:
        return repack_parts([raw], type_name, k, kl=kl)
    return _repack_torch(raw, type_name, k)


def _repack_torch(raw: torch.Tensor, type_name: str, k: int) -> KQuantWeight:
    """repack's torch path (no C kernels), the reference of the C one."""
    n, nb = raw.shape[0], k // QK
    b = raw.reshape(n, nb, FILE_BYTES[type_name])
    sc, mn = _scales_mins(b[..., 4:16])
    data = torch.cat([b[..., 0:4], sc, mn, b[..., 16:]], -1)  # d, dmin | sc | m | (qh) qs
    return KQuantWeight(type_name, n, k, data.reshape(n, -1).contiguous())


def repack_parts(raws: list[torch.Tensor], type_name: str, k: int, *, kl: CKernels | None = None) -> KQuantWeight:
    """Several tensors' blocks (a merged layer's parts of one kind, rows one after another) -> one weight in the
    kernels' layout, each part repacked in C straight into its rows (no concatenated copy of the file's bytes)."""
    expect(len(raws) > 0, "repack_parts takes at least one tensor")
    if type_name in AS_STORED or len(raws) == 1 and kl is None:
        return repack(torch.cat(raws) if len(raws) > 1 else raws[0], type_name, k, kl=kl)
    kl = _require(kl)
    nb = k // BLOCK_VALUES[type_name]
    for raw in raws:
        check_tensor("raw", raw, 2, (torch.uint8,))
        expect(k % BLOCK_VALUES[type_name] == 0 and k > 0 and raw.shape[1] == nb * FILE_BYTES[type_name],
               f"{type_name} rows of {k} values take {nb * FILE_BYTES[type_name]} bytes, got {raw.shape[1]}")
    out = torch.empty((sum(r.shape[0] for r in raws), nb * BLOCK_BYTES[type_name]), dtype=torch.uint8)
    row = 0
    for raw in raws:
        src = raw.contiguous()
        kl.fn("rg_gguf_k_repack")(raw=src.data_ptr(), kind=KINDS[type_name], N=src.shape[0], K=k,
                                  out=out[row].data_ptr())
        row += src.shape[0]
    return KQuantWeight(type_name, out.shape[0], k, out)


def unpack(w: KQuantWeight) -> torch.Tensor:
    """The dense (n, k) float32 weight, decoded from the layout in torch: w = d sc q - dmin m (Q6_K: d sc (q - 32))."""
    b = w.data.view(w.n, w.k // BLOCK_VALUES[w.type_name], BLOCK_BYTES[w.type_name])
    if w.type_name == "Q6_K":
        return _unpack_q6_k(b, w.n, w.k)
    if w.type_name in ("Q4_0", "Q4_1", "Q8_0"):
        return _unpack_32(b, w.type_name).reshape(w.n, w.k)
    d, dmin = (b[..., lo:lo + 2].contiguous().view(torch.float16).float() for lo in (0, 2))  # (n, nb, 1)
    sc, mn = b[..., 4:12].float(), b[..., 12:20].float()
    qs = b[..., -128:].view(w.n, -1, 4, 32)  # (n, nb, chunk, 32)
    q = torch.stack([qs & 15, qs >> 4], 3)  # (n, nb, chunk, half, 32)
    if w.type_name == "Q5_K":
        qh = b[..., 20:52][:, :, None, None, :]  # (n, nb, 1, 1, 32)
        shift = (2 * torch.arange(4)[:, None] + torch.arange(2)).to(torch.uint8)  # (chunk, half): bit 2c + half
        q = q | (((qh >> shift[..., None]) & 1) << 4)
    q = q.reshape(w.n, -1, 8, 32).float()
    out = (d * sc)[..., None] * q - (dmin * mn)[..., None]
    return out.reshape(w.n, w.k)


def _unpack_32(b: torch.Tensor, type_name: str) -> torch.Tensor:
    """(n, blocks, bytes) Q4_0 / Q4_1 / Q8_0 blocks -> (n, blocks, 32) float32: d (q - 8), d q + m, d q."""
    d = b[..., 0:2].contiguous().view(torch.float16).float()  # (n, nb, 1)
    if type_name == "Q8_0":
        return d * b[..., 2:].contiguous().view(torch.int8).float()
    qs = b[..., -16:]
    q = torch.cat([qs & 15, qs >> 4], -1).float()  # values j < 16 in the low nibbles, then the high ones
    if type_name == "Q4_0":
        return d * (q - 8)
    return d * q + b[..., 2:4].contiguous().view(torch.float16).float()


def _unpack_q6_k(b: torch.Tensor, n: int, k: int) -> torch.Tensor:
    ql = b[..., :128].reshape(n, -1, 2, 2, 32)  # (n, nb, half, c % 2, l)
    qh = b[..., 128:192].reshape(n, -1, 2, 1, 32)  # (n, nb, half, 1, l)
    low = torch.cat([ql & 15, ql >> 4], 3)  # (n, nb, half, c, l): c < 2 low nibbles, then high
    shift = (2 * torch.arange(4)).to(torch.uint8)[:, None]  # qh bits 2c, 2c + 1
    q = (low | (((qh >> shift) & 3) << 4)).float() - 32
    sc = b[..., 192:208].contiguous().view(torch.int8).float()  # (n, nb, 16)
    d = b[..., 208:210].contiguous().view(torch.float16).float()  # (n, nb, 1)
    return ((d * sc)[..., None] * q.reshape(n, -1, 16, 16)).reshape(n, k)


def linear_ref(w: KQuantWeight, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """float32 x @ unpack(w)^T (+ bias), in x's dtype."""
    return F.linear(x.float(), unpack(w), None if bias is None else bias.float()).to(x.dtype)


_BF16_ROWS = 8  # csrc/cpu_gguf_q.h GQ_POOL_MAX_M: rows up to which bf16 inputs take rg_gguf_q_linear_bf16


def _require(kl: CKernels | None) -> CKernels:
    from .cpu import _require

    return _require(kl)


def linear(w, x: torch.Tensor, bias: torch.Tensor | None = None, *, kl: CKernels | None = None) -> torch.Tensor:
    """y (M, N) = x (M, K) @ w^T (+ bias (N,)), x float32 or bf16 on the CPU, in x's dtype; w a KQuantWeight or
    another GGUF block weight naming its C entry points (cpu_gguf_more.BlockWeight)."""
    kl = _require(kl)
    expect(isinstance(getattr(w, "entry", None), str) and isinstance(getattr(w, "data", None), torch.Tensor),
           f"expected a GGUF block weight (KQuantWeight, BlockWeight), got {type(w).__name__}")
    check_tensor("x", x, 2, (torch.float32, torch.bfloat16))
    expect(x.device.type == "cpu", f"x must be a CPU tensor, got {x.device}")
    expect(x.shape[1] == w.k, f"x must have {w.k} columns, got shape {tuple(x.shape)}")
    if bias is not None:
        check_tensor("bias", bias, 1, (x.dtype, torch.float32))
        expect(bias.shape[0] == w.n, f"bias must have {w.n} elements, got {bias.shape[0]}")
    return _linear(kl, w, x, bias)


def _linear(kl: CKernels, w, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    if (bias is None and x.dtype == torch.bfloat16 and x.shape[0] <= _BF16_ROWS and w.k <= 4096
            and w.entry == "rg_gguf_k" and w.kind >= KINDS["Q4_0"]):
        # a bf16 model's decode rows: one call that widens and rounds itself, the same bits as the float32 entry
        # then .to(bfloat16), without the two conversions (which cost more than a small matmul on one core)
        x = x.contiguous()
        y = torch.empty((x.shape[0], w.n), dtype=torch.bfloat16)
        kl.fn("rg_gguf_q_linear_bf16")(w=w.data.data_ptr(), kind=w.kind, N=w.n, K=w.k, x=x.data_ptr(),
                                       M=x.shape[0], y=y.data_ptr())
        return y
    xf = x.float().contiguous()
    y = torch.empty((xf.shape[0], w.n), dtype=torch.float32)
    kl.fn(f"{w.entry}_linear")(w=w.data.data_ptr(), kind=w.kind, N=w.n, K=w.k, x=xf.data_ptr(), M=xf.shape[0],
                               y=y.data_ptr())
    if bias is not None:
        y += bias.float()
    return y.to(x.dtype)


def rows(w, ids: torch.Tensor, dtype: torch.dtype = torch.float32, *,
         kl: CKernels | None = None) -> torch.Tensor:
    """(len(ids), k) rows `ids` of the weight, dequantized, in `dtype`."""
    kl = _require(kl)
    check_tensor("ids", ids, 1, (torch.int64,))
    ids = ids.contiguous()
    expect(ids.numel() == 0 or (int(ids.min()) >= 0 and int(ids.max()) < w.n), f"ids must lie in [0, {w.n})")
    return _rows(kl, w, ids, dtype)


def _rows(kl: CKernels, w, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    out = torch.empty((ids.shape[0], w.k), dtype=torch.float32)
    kl.fn(f"{w.entry}_rows")(w=w.data.data_ptr(), kind=w.kind, N=w.n, K=w.k, ids=ids.data_ptr(), n=ids.shape[0],
                             out=out.data_ptr())
    return out.to(dtype)
