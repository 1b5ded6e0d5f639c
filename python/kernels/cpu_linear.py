"""CPU linear layers: a weight packed once into the layout its C matmul reads (csrc/cpu_linear.h), and the matmul
and row gather over it.

A `PackedWeight` is one (N, K) weight in one layout, a flat tensor plus the descriptor the C kernels take:
`pack_rows` (a bf16 embedding table as it is), `pack_bf16` (K pairs), `pack_int8` (int8 values, a float32 scale
per row and group), `pack_int4` (4-bit values, an fp16 scale and offset per row and group). `linear` computes
y = x @ w^T (+ bias) for float32 or bf16 x, `rows` gathers dequantized rows (an embedding lookup). The torch
references: `unpack` (the dense float32 weight, decoded from the layout in torch) and `linear_ref`.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F

from ._checks import check_contiguous, check_tensor, expect
from ._cpu_bindings import CKernels, WeightDesc, libc_function

KIND_ROWS, KIND_BF16, KIND_INT8, KIND_INT4 = 0, 1, 2, 3  # csrc/cpu_linear.h's RG_W_*
KIND_NAMES = {KIND_ROWS: "bf16 rows", KIND_BF16: "bf16", KIND_INT8: "int8", KIND_INT4: "int4"}
SUFFIX = {torch.float32: "f32", torch.bfloat16: "bf16"}


@dataclass(eq=False)
class PackedWeight:
    """One (n, k) weight in the layout of `kind` (see csrc/cpu_linear.h). `data` must stay alive and in place as
    long as the descriptor is used (this object holds it)."""

    kind: int
    n: int
    k: int
    data: torch.Tensor
    group: int = 0
    zero_points: bool = False
    desc: WeightDesc = field(init=False)

    def __post_init__(self) -> None:
        self.desc = WeightDesc(self.kind, self.n, self.k, self.group, int(self.zero_points), self.data.data_ptr())

    def fix_order(self, k_split: int = 0, partial: bool = False) -> None:
        """The deterministic mode's row-parallel matmul (csrc/cpu_linear.h's k_split and partial; bf16 K pairs on
        AVX512-BF16 only): with k_split, input columns [0, k_split) and [k_split, k) summed apart and added before
        the one rounding, as two tensor-parallel ranks holding them give; partial: this is such a rank's share, and
        float32 outputs are its unrounded partial sums (no bias), which `sum_partials` adds."""
        expect(self.kind == KIND_BF16, f"a fixed summation order needs bf16 K pairs, got {self!r}")
        expect(k_split == 0 or (0 < k_split < self.k and k_split % 2 == 0),
               f"k_split must be an even column inside (0, {self.k}), got {k_split}")
        self.desc.k_split, self.desc.partial = k_split, int(partial)

    @property
    def ref(self):
        """The descriptor by reference, as the C functions take it."""
        return ctypes.byref(self.desc)

    @property
    def nbytes(self) -> int:
        return self.data.numel() * self.data.element_size()

    def __repr__(self) -> str:
        group = f", group {self.group}" if self.kind in (KIND_INT8, KIND_INT4) else ""
        return f"PackedWeight({KIND_NAMES[self.kind]}, {self.n} x {self.k}{group}, {self.nbytes} bytes)"


def _blocks(t: torch.Tensor) -> torch.Tensor:
    """t (N, ...) with its rows padded with zeros to a multiple of 16."""
    pad = -t.shape[0] % 16
    return t if pad == 0 else torch.cat([t, t.new_zeros((pad, *t.shape[1:]))])


def _check_groups(k: int, group: int, multiple: int, what: str) -> None:
    expect(group > 0 and group % multiple == 0 and k % group == 0,
           f"{what}: the group size must be a positive multiple of {multiple} dividing the input size {k}, "
           f"got group {group}")


def pack_rows(w: torch.Tensor) -> PackedWeight:
    """A (N, K) bf16 table read by rows only (an untied embedding), in place."""
    check_tensor("w", w, 2, (torch.bfloat16,))
    check_contiguous("w", w)
    return PackedWeight(KIND_ROWS, w.shape[0], w.shape[1], w)


def pack_bf16(w: torch.Tensor) -> PackedWeight:
    """(N, K) float weight -> bf16 K pairs: [N/16][K/2][16][2]."""
    check_tensor("w", w, 2, (torch.float32, torch.bfloat16, torch.float16))
    n, k = w.shape
    expect(k % 2 == 0, f"the bf16 layout needs an even input size, got {k}")
    blocks = _blocks(w.to(torch.bfloat16))
    data = blocks.view(-1, 16, k // 2, 2).permute(0, 2, 1, 3).contiguous().view(-1)
    return PackedWeight(KIND_BF16, n, k, data)


def pack_int8(q: torch.Tensor, scales: torch.Tensor, group: int) -> PackedWeight:
    """q (N, K) int8 and scales (N, K / group) -> per block and group: 16 float32 scales, then the group's values
    in K-pair order; w = scales * q."""
    check_tensor("q", q, 2, (torch.int8,))
    n, k = q.shape
    _check_groups(k, group, 16, "int8")
    ng = k // group
    check_tensor("scales", scales, 2, (torch.float32, torch.float16, torch.bfloat16))
    expect(tuple(scales.shape) == (n, ng), f"scales must be ({n}, {ng}), got {tuple(scales.shape)}")
    values = _blocks(q).view(-1, 16, ng, group // 2, 2).permute(0, 2, 3, 1, 4)  # (block, group, pair, row, 2)
    s = _blocks(scales.float()).view(-1, 16, ng).permute(0, 2, 1).contiguous()  # (block, group, row)
    nb = values.shape[0]
    data = torch.cat([s.view(torch.uint8).view(nb, ng, 64), values.reshape(nb, ng, 16 * group).view(torch.uint8)], 2)
    return PackedWeight(KIND_INT8, n, k, data.contiguous().view(-1), group)


def pack_int4(q: torch.Tensor, scales: torch.Tensor, offsets: torch.Tensor, group: int,
              zero_points: bool) -> PackedWeight:
    """q (N, K) uint8 in 0..15, scales and offsets (N, K / group) (fp16 exactly: they are stored as fp16) ->
    per block and group: 16 fp16 scales, 16 fp16 offsets, then per quad of columns 32 bytes (see the header).
    w = scales * q + offsets, or with zero_points w = scales * (q - offsets)."""
    check_tensor("q", q, 2, (torch.uint8,))
    n, k = q.shape
    _check_groups(k, group, 32, "int4")
    ng = k // group
    for name, t in (("scales", scales), ("offsets", offsets)):
        check_tensor(name, t, 2, (torch.float32, torch.float16, torch.bfloat16))
        expect(tuple(t.shape) == (n, ng), f"{name} must be ({n}, {ng}), got {tuple(t.shape)}")
    expect(int(q.max()) <= 15 if q.numel() else True, "q holds 4-bit values: 0..15")
    # column 4c + 2h + t of a group: quad c, byte 2j + t, nibble h (low for pair 2c, high for pair 2c+1)
    v = _blocks(q).view(-1, 16, ng, group // 4, 2, 2).permute(0, 2, 3, 1, 5, 4)  # (block, group, quad, row, t, h)
    nb = v.shape[0]
    nibbles = (v[..., 0] | (v[..., 1] << 4)).reshape(nb, ng, 8 * group)
    meta = [_blocks(t.to(torch.float16)).view(-1, 16, ng).permute(0, 2, 1).contiguous().view(torch.uint8)
            for t in (scales, offsets)]  # (block, group, 32 bytes) each
    data = torch.cat([*meta, nibbles], 2)
    return PackedWeight(KIND_INT4, n, k, data.contiguous().view(-1), group, zero_points)


def unpack(pw: PackedWeight) -> torch.Tensor:
    """The dense (n, k) float32 weight of `pw`, decoded in torch: the reference of the C kernels' reading."""
    n, k = pw.n, pw.k
    if pw.kind == KIND_ROWS:
        return pw.data.float()
    if pw.kind == KIND_BF16:
        return pw.data.view(-1, k // 2, 16, 2).permute(0, 2, 1, 3).reshape(-1, k)[:n].float()
    g, ng = pw.group, k // pw.group
    if pw.kind == KIND_INT8:
        data = pw.data.view(-1, ng, 64 + 16 * g)
        s = data[..., :64].contiguous().view(torch.float32)  # (block, group, row)
        q = data[..., 64:].contiguous().view(torch.int8).view(-1, ng, g // 2, 16, 2).permute(0, 3, 1, 2, 4)
        w = q.float() * s.transpose(1, 2)[..., None, None]
        return w.reshape(-1, k)[:n]
    data = pw.data.view(-1, ng, 64 + 8 * g)
    s, o = (data[..., lo:lo + 32].contiguous().view(torch.float16).float() for lo in (0, 32))  # (block, group, row)
    b = data[..., 64:].view(-1, ng, g // 4, 16, 2)  # (block, group, quad, row, t)
    q = torch.stack([b & 15, b >> 4], -1).permute(0, 3, 1, 2, 5, 4).float()  # (block, row, group, quad, h, t)
    s, o = (t.transpose(1, 2)[..., None, None, None] for t in (s, o))
    w = s * (q - o) if pw.zero_points else s * q + o
    return w.reshape(-1, k)[:n]


def dense_bf16(pw: PackedWeight) -> torch.Tensor:
    """The (n, k) row-major bf16 weight of a K-pair layout, copied out: each (row, pair) is one 32-bit word, so the
    copy is a transpose of int32 blocks (K / 2, 16) -> (16, K / 2). What oneDNN's matmul reads (tiles on AMX).
    numpy's strided copy does it about 5x faster than torch's (0.9 against 4-8 ms for 896 x 4864 here)."""
    expect(pw.kind == KIND_BF16, f"dense_bf16 reads bf16 K pairs, got {pw!r}")
    words = pw.data.view(torch.int32).view(-1, pw.k // 2, 16).numpy()
    rows = torch.from_numpy(np.ascontiguousarray(words.transpose(0, 2, 1)))
    return rows.view(torch.bfloat16).view(-1, pw.k)[:pw.n]


def linear_ref(pw: PackedWeight, x: torch.Tensor, bias: torch.Tensor | None = None,
               float_out: bool = False) -> torch.Tensor:
    """The reference of `linear`: x @ unpack(pw)^T (+ bias) in float32, rounded to x's dtype (and widened back with
    float_out)."""
    y = F.linear(x.float(), unpack(pw), None if bias is None else bias.float()).to(x.dtype)
    return y.float() if float_out else y


def check_packed(pw: PackedWeight, matmul: bool) -> None:
    expect(isinstance(pw, PackedWeight), f"expected a PackedWeight, got {type(pw).__name__}")
    expect(not (matmul and pw.kind == KIND_ROWS), "a bf16 rows table is read by rows only, not multiplied")


def linear(pw: PackedWeight, x: torch.Tensor, bias: torch.Tensor | None = None, *, float_out: bool = False,
           amx: bool = False, kl: CKernels | None = None) -> torch.Tensor:
    """y (M, N) = x (M, K) @ w^T (+ bias (N,)), x float32 or bf16 on the CPU; computed in float32 and rounded to
    x's dtype once, returned in that dtype or, with float_out, widened to float32 (logits). amx: on the AMX tile
    GEMM (`amx_covers`: a build and process with the tiles, bf16 x, an input size that is a multiple of 32)."""
    from .cpu import _require

    kl = _require(kl)
    check_packed(pw, True)
    check_tensor("x", x, 2, tuple(SUFFIX))
    expect(x.shape[1] == pw.k, f"x must have {pw.k} columns, got shape {tuple(x.shape)}")
    expect(x.device.type == "cpu", f"x must be a CPU tensor, got {x.device}")
    if bias is not None:
        check_tensor("bias", bias, 1, (x.dtype,))
        expect(bias.shape[0] == pw.n, f"bias must have {pw.n} elements, got {bias.shape[0]}")
    if amx:
        expect(kl.has_amx, f"the AMX GEMM is not in this build or process ({kl.isa})")
        expect(amx_covers(kl, pw) and x.dtype == torch.bfloat16,
               f"the AMX GEMM takes bf16 x and an input size that is a multiple of 32 without a fixed summation "
               f"order, got {x.dtype} and {pw!r}")
    return _linear(kl, pw, x.contiguous(), None if bias is None else bias.contiguous(), float_out, amx)


def amx_covers(kl: CKernels, pw: PackedWeight) -> bool:
    """Whether the AMX tile GEMM (csrc/cpu_linear_amx.h) runs pw's matmul in this build and process: whole K tiles
    (32 columns), not the deterministic mode's fixed summation order."""
    return kl.has_amx and pw.kind != KIND_ROWS and pw.k % 32 == 0 and not (pw.desc.k_split or pw.desc.partial)


def _linear(kl: CKernels, pw: PackedWeight, x: torch.Tensor, bias: torch.Tensor | None,
            float_out: bool = False, amx: bool = False) -> torch.Tensor:
    m = x.shape[0]
    y = torch.empty((m, pw.n), dtype=torch.float32 if float_out else x.dtype)
    fn = kl.fn("rg_linear_amx_bf16") if amx else kl.fn("linear", SUFFIX[x.dtype])
    fn(w=pw.ref, x=x.data_ptr(), M=m, bias=None if bias is None else bias.data_ptr(),
       y=None if float_out else y.data_ptr(), yf=y.data_ptr() if float_out else None)
    return y


def sum_partials(kl: CKernels, parts: torch.Tensor, bias: torch.Tensor | None = None,
                 out: torch.Tensor | None = None) -> torch.Tensor:
    """(S, M, N) float32 partial sums of S ranks (`fix_order(partial=True)` weights, in rank order) -> (M, N) bf16:
    added in that order, plus bias (N,) bf16, rounded once, with the instructions of a k_split matmul (into `out`
    when given, contiguous)."""
    check_tensor("parts", parts, 3, (torch.float32,))
    check_contiguous("parts", parts)
    s, m, n = parts.shape
    if out is None:
        out = torch.empty((m, n), dtype=torch.bfloat16)
    expect(out.dtype == torch.bfloat16 and out.is_contiguous() and out.numel() == m * n,
           f"out: expected a contiguous bf16 tensor of {m} x {n} values")
    if bias is not None:
        check_tensor("bias", bias, 1, (torch.bfloat16,))
        expect(bias.shape[0] == n and bias.is_contiguous(), f"bias must be {n} contiguous values")
    kl.fn("rg_sum_partials_bf16")(parts=parts.data_ptr(), S=s, M=m, N=n,
                                  bias=None if bias is None else bias.data_ptr(), out=out.data_ptr())
    return out


def rows(pw: PackedWeight, ids: torch.Tensor, dtype: torch.dtype = torch.bfloat16, *,
         kl: CKernels | None = None) -> torch.Tensor:
    """(len(ids), k) rows `ids` of the weight, dequantized to `dtype` (float32 or bf16): an embedding lookup."""
    from .cpu import _require

    check_packed(pw, False)
    check_tensor("ids", ids, 1, (torch.int64,))
    expect(dtype in SUFFIX, f"dtype must be float32 or bfloat16, got {dtype}")
    ids = ids.contiguous()
    expect(ids.numel() == 0 or (int(ids.min()) >= 0 and int(ids.max()) < pw.n), f"ids must lie in [0, {pw.n})")
    return _rows(_require(kl), pw, ids, dtype)


def _rows(kl: CKernels, pw: PackedWeight, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    out = torch.empty((ids.shape[0], pw.k), dtype=dtype)
    kl.fn("weight_rows", SUFFIX[dtype])(w=pw.ref, ids=ids.data_ptr(), n=ids.shape[0], out=out.data_ptr())
    return out


_MADV_HUGEPAGE = 14  # linux/mman.h
_HUGE_PAGE = 2 << 20


def _advise_huge_pages(t: torch.Tensor) -> bool:
    """madvise(MADV_HUGEPAGE) over the 2 MiB pages inside t's memory, before it is touched; False where that is not
    available (not Linux, or transparent huge pages off)."""
    madvise = libc_function("madvise")
    if madvise is None:
        return False
    start = -(-t.data_ptr() // _HUGE_PAGE) * _HUGE_PAGE
    end = (t.data_ptr() + t.numel() * t.element_size()) // _HUGE_PAGE * _HUGE_PAGE
    if end <= start:
        return False
    madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    return madvise(start, end - start, _MADV_HUGEPAGE) == 0


def gather(weights: list[PackedWeight]) -> torch.Tensor | None:
    """Move the weights into one arena, back to back in the given order (a decode step's), on huge pages where the
    system gives them; each PackedWeight's data becomes a view of it and its descriptor points there, so whoever
    holds it keeps working. A decode step then streams one sequence instead of a few hundred separate mappings of
    4 KiB pages: on a Xeon, about 5% faster at batch 1 (fewer TLB misses, every stream's pages found at once).
    Each old tensor is freed as soon as it is copied (when nothing else holds it), so resident memory grows by one
    weight at most. Returns the arena (None for no weights); the views keep it alive."""
    unique = list({id(w): w for w in weights}.values())  # a tied LM head and embedding share one
    if not unique:
        return None
    offsets, total = [], 0
    for w in unique:
        offsets.append(total)
        total += -(-w.nbytes // 64) * 64
    arena = torch.empty(total + _HUGE_PAGE, dtype=torch.uint8)
    shift = -arena.data_ptr() % _HUGE_PAGE  # the arena starts on a huge page
    arena = arena[shift:shift + total]
    _advise_huge_pages(arena)
    for w, off in zip(unique, offsets, strict=True):
        view = arena[off:off + w.nbytes]
        view.copy_(w.data.reshape(-1).view(torch.uint8))
        w.data = view.view(w.data.dtype).view(w.data.shape)
        w.desc.data = w.data.data_ptr()
    return arena
