"""CPU kernels in C (csrc/cpu_kernels.c), built on first use with the system C compiler and called through
ctypes: decode attention through the slot table, KV store, fused residual-add RMSNorm and in-place rotary
embedding, for float32 and bfloat16 CPU tensors; and, on CPUs with AVX512-BF16, bf16 extend attention, SiLU,
segmented LoRA deltas and the fused decode step (radixgen.kernels.cpu_fused).

They exist because on a small CPU a decode step is dominated by per-op overhead and by copies (gathering a
batch's KV into contiguous tensors before scaled_dot_product_attention); each kernel here is one call that
reads the pool in place. `lib()` is this CPU's build (_cpu_build.py: -march=native, cached); `load(isa)` any
other instruction set's (the tests check every variant). When no compiler is found or the build fails,
`lib()` is None and the runtime chooses its plain-torch ops; RADIXGEN_DISABLE_CPU_KERNELS=1 forces that.
RADIXGEN_CPU_ISA=<one of _cpu_build.ISAS> makes `lib()` that instruction set's build instead of the native one:
the answers of a CPU without AMX or AVX512-BF16 (another bf16 rounding, no fused decode step) can be seen here;
RADIXGEN_DISABLE_AMX=1 keeps the native build but turns its AMX prefill GEMM off (`CKernels.has_amx`).
Every entry point is declared once, with typed and named arguments, in _cpu_bindings.py.

Each public function checks its arguments (and takes the build to use as `kl`, this CPU's by default); its
torch reference is the one of the Triton kernel of the same job (store_kv_ref, decode_attention_ref,
fused_add_rmsnorm_ref, rotary_embedding_ref_, lora_shrink_ref + lora_expand_ref_). The runtime's CPU ops call
the unchecked `_name(kl, ...)` entry points on their hot path.
"""

from __future__ import annotations

import logging
import os
import threading
from pathlib import Path

import torch

from . import _cpu_build
from ._checks import check_contiguous, check_dim, check_kv_pool, check_tensor, expect
from ._cpu_bindings import CKernelError, CKernels, LayerBF16
from .kv_quant import C_SUFFIX

logger = logging.getLogger(__name__)

__all__ = ["CKernelError", "CKernels", "LayerBF16", "available", "lib", "load", "unavailable_reason"]

SUFFIX = {torch.float32: "f32", torch.bfloat16: "bf16"}  # the C name suffix of each dtype's kernels
DTYPES = tuple(SUFFIX)

_lock = threading.Lock()
_lib: CKernels | None = None
_failed: str | None = None


def load(isa: str = "native", out_dir: Path | None = None) -> CKernels:
    """A build of the kernels for instruction set `isa` (see _cpu_build.ISAS), compiled if needed and loaded
    (a separate library per file: several builds can be loaded side by side). RuntimeError where this CPU lacks
    what the build needs (RADIXGEN_CPU_ISA=cooperlake on an AVX2 CPU: `lib()` then falls back to the torch path)."""
    missing = _cpu_build.missing_flags(isa)
    if missing:
        raise RuntimeError(f"this CPU cannot run the {isa} build of the CPU kernels: it lacks {', '.join(missing)}")
    return CKernels(_cpu_build.build(isa, out_dir), isa)


def lib() -> CKernels | None:
    """This CPU's build, made on the first call; None when disabled or the build failed."""
    global _lib, _failed
    if _lib is not None or _failed is not None:
        return _lib
    with _lock:
        if _lib is None and _failed is None:
            if os.environ.get("RADIXGEN_DISABLE_CPU_KERNELS", "") not in ("", "0"):
                _failed = "disabled by RADIXGEN_DISABLE_CPU_KERNELS"
            else:
                try:
                    _lib = load(os.environ.get("RADIXGEN_CPU_ISA") or "native")
                except (RuntimeError, OSError) as exc:
                    _failed = str(exc)
                    logger.warning("CPU kernels unavailable, using the torch path: %s", exc)
    return _lib


def available() -> bool:
    return lib() is not None


def unavailable_reason() -> str | None:
    lib()
    return _failed


def _require(kl: CKernels | None = None) -> CKernels:
    if kl is not None:
        return kl
    k = lib()
    if k is None:
        raise RuntimeError(f"the CPU kernels are unavailable: {_failed}")
    return k


def _check_cpu(**tensors: torch.Tensor) -> None:
    for name, t in tensors.items():
        expect(t.device.type == "cpu", f"{name} must be a CPU tensor, got device {t.device}")


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


# ---------------------------------------------------------------------------------------------- store_kv


def store_kv(k_buffer: torch.Tensor, v_buffer: torch.Tensor, slots: torch.Tensor, k: torch.Tensor,
             v: torch.Tensor, *, k_scales: torch.Tensor | None = None, v_scales: torch.Tensor | None = None,
             kl: CKernels | None = None) -> None:
    """Write k/v (T, Hkv, D) (rows may be strided; heads and dims contiguous) into the buffers at `slots`; an
    8-bit pool (codes with k_scales / v_scales, see radixgen.kernels.kv_quant) gets them quantized."""
    quantized = check_kv_pool(k_buffer, v_buffer, k_scales, v_scales, DTYPES)
    check_tensor("slots", slots, 1, (torch.int64,))
    for name, t in (("k", k), ("v", v)):
        check_tensor(name, t, 3, DTYPES if quantized else (k_buffer.dtype,))
        check_dim(name, t, 0, slots.shape[0], "one row per slot")
        expect(t.shape[1:] == k_buffer.shape[1:], f"{name} rows must be {tuple(k_buffer.shape[1:])}")
        expect(t.stride(2) == 1 and t.stride(1) == t.shape[2], f"{name} heads and dims must be contiguous")
    expect(v.dtype == k.dtype, "k and v must share a dtype")
    _check_cpu(k_buffer=k_buffer, v_buffer=v_buffer, slots=slots, k=k, v=v)
    expect(not quantized or k_buffer.shape[2] <= _require(kl).d_max, f"head_dim exceeds {_require(kl).d_max}")
    slots = slots.contiguous()
    expect(slots.numel() == 0 or (int(slots.min()) >= 0 and int(slots.max()) < k_buffer.shape[0]),
           f"slots must lie in [0, {k_buffer.shape[0]})")
    _store_kv(_require(kl), k_buffer, v_buffer, slots, k, v, k_scales, v_scales)


def _store_kv(kl: CKernels, k_buffer, v_buffer, slots, k, v, k_scales=None, v_scales=None) -> None:
    if k_scales is None:
        kl.fn("store_kv", SUFFIX[k_buffer.dtype])(
            k=k.data_ptr(), k_stride=k.stride(0), v=v.data_ptr(), v_stride=v.stride(0), k_buf=k_buffer.data_ptr(),
            v_buf=v_buffer.data_ptr(), slots=slots.data_ptr(), n_tok=slots.shape[0],
            row_elems=k_buffer.shape[1] * k_buffer.shape[2])
        return
    kl.fn(f"store_kv_{C_SUFFIX[k_buffer.dtype]}", SUFFIX[k.dtype])(
        k=k.data_ptr(), k_stride=k.stride(0), v=v.data_ptr(), v_stride=v.stride(0), k_buf=k_buffer.data_ptr(),
        v_buf=v_buffer.data_ptr(), k_scale=k_scales.data_ptr(), v_scale=v_scales.data_ptr(), slots=slots.data_ptr(),
        n_tok=slots.shape[0], Hkv=k_buffer.shape[1], D=k_buffer.shape[2])


def _pool_kwargs(k_buffer, v_buffer, k_scales, v_scales) -> dict:
    """The pool arguments of a decode or extend kernel: buffers, and an 8-bit pool's scales."""
    pool = {"k_buf": k_buffer.data_ptr(), "v_buf": v_buffer.data_ptr()}
    if k_scales is not None:
        pool.update(k_scale=k_scales.data_ptr(), v_scale=v_scales.data_ptr())
    return pool


def _pool_kernel(name: str, k_buffer: torch.Tensor, dtype_suffix: str) -> str:
    """The C name of kernel `name` over this pool: rg_<name>_<dtype>, or rg_<name>_<code>_<dtype> (8-bit)."""
    code = C_SUFFIX.get(k_buffer.dtype)
    return f"rg_{name}_{code}_{dtype_suffix}" if code else f"rg_{name}_{dtype_suffix}"


def _check_attention_pool(q, k_buffer, v_buffer, k_scales, v_scales, q_dtypes) -> None:
    check_tensor("q", q, 3, q_dtypes)
    quantized = check_kv_pool(k_buffer, v_buffer, k_scales, v_scales, q_dtypes)
    expect(quantized or k_buffer.dtype == q.dtype, f"q dtype {q.dtype} must equal the pool dtype {k_buffer.dtype}")
    check_dim("k_buffer", k_buffer, 2, q.shape[2], "head_dim")
    expect(q.shape[1] % k_buffer.shape[1] == 0, f"query heads ({q.shape[1]}) must be a multiple of KV heads "
           f"({k_buffer.shape[1]})")
    expect(q.stride(2) == 1 and q.stride(1) == q.shape[2], "q heads and dims must be contiguous")


# ------------------------------------------------------------------------------------- decode attention


# The deterministic mode's pieces of decode attention: every context is cut at multiples of this many positions
# whatever the batch, so a query's sums run in one order (a multiple of the 16-key blocks the kernel scores).
# 128: few enough pieces to merge at batch 64, two per thread at batch 1 from 256 positions on.
FIXED_PIECE = 128


def num_splits(batch: int, max_len: int, threads: int) -> int:
    """Pieces per request along the context: at least 4 work items per thread when the contexts allow it,
    no piece shorter than 64 positions."""
    if batch >= 4 * threads:
        return 1
    return max(1, min(-(-4 * threads // batch), max_len // 64))


def context_split(batch: int, max_len: int, threads: int, piece: int = 0) -> tuple[int, int]:
    """(splits, piece) of decode attention: piece 0 picks `num_splits` equal pieces per context (they follow the
    batch); a piece > 0 is kept, with as many pieces as the longest context needs (fixed cuts)."""
    if piece > 0:
        return max(1, -(-max_len // piece)), piece
    return num_splits(batch, max_len, threads), 0


def decode_attention(q: torch.Tensor, k_buffer: torch.Tensor, v_buffer: torch.Tensor, req_to_slot: torch.Tensor,
                     req_indices: torch.Tensor, seq_lens: torch.Tensor, sm_scale: float, *,
                     k_scales: torch.Tensor | None = None, v_scales: torch.Tensor | None = None,
                     kl: CKernels | None = None, piece: int = 0) -> torch.Tensor:
    """q (B, Hq, D) (rows may be strided) -> o (B, Hq, D): request b attends to the first seq_lens[b] slots
    of row req_indices[b] of req_to_slot (R, C), int64 everywhere. The pool is in q's dtype, or 8-bit codes
    with k_scales / v_scales (radixgen.kernels.kv_quant). piece > 0: each context summed in fixed pieces of that
    many positions (a multiple of 16), so a row's result does not depend on the other rows (FIXED_PIECE)."""
    _check_attention_pool(q, k_buffer, v_buffer, k_scales, v_scales, DTYPES)
    check_tensor("req_to_slot", req_to_slot, 2, (torch.int64,))
    expect(req_to_slot.stride(1) == 1, "req_to_slot rows must be contiguous")
    check_tensor("req_indices", req_indices, 1, (torch.int64,))
    check_tensor("seq_lens", seq_lens, 1, (torch.int64,))
    check_dim("req_indices", req_indices, 0, q.shape[0], "batch")
    check_dim("seq_lens", seq_lens, 0, q.shape[0], "batch")
    expect(isinstance(sm_scale, (int, float)) and sm_scale > 0, f"sm_scale must be positive, got {sm_scale!r}")
    expect(isinstance(piece, int) and piece >= 0 and piece % 16 == 0,
           f"piece must be 0 or a positive multiple of 16, got {piece!r}")
    _check_cpu(q=q, k_buffer=k_buffer, v_buffer=v_buffer, req_to_slot=req_to_slot, req_indices=req_indices,
               seq_lens=seq_lens)
    kl = _require(kl)
    expect(q.shape[2] <= kl.d_max, f"head_dim {q.shape[2]} exceeds {kl.d_max}")
    if q.shape[0]:
        expect(int(seq_lens.min()) >= 1 and int(seq_lens.max()) <= req_to_slot.shape[1],
               f"seq_lens must lie in [1, {req_to_slot.shape[1]}]")
        expect(int(req_indices.min()) >= 0 and int(req_indices.max()) < req_to_slot.shape[0],
               f"req_indices must lie in [0, {req_to_slot.shape[0]})")
    return _decode_attention(kl, q, k_buffer, v_buffer, req_to_slot, req_indices.contiguous(),
                             seq_lens.contiguous(), float(sm_scale), int(seq_lens.max()) if q.shape[0] else 0,
                             k_scales, v_scales, piece=piece)


def _decode_attention(kl: CKernels, q, k_buffer, v_buffer, req_to_slot, req_indices, seq_lens, sm_scale: float,
                      max_len: int, k_scales=None, v_scales=None, requests: int | None = None,
                      piece: int = 0) -> torch.Tensor:
    """requests: the batch size to split the contexts for, where it is not q's rows (a verification's requests,
    several rows each); piece > 0: fixed pieces instead (context_split)."""
    b, h, d = q.shape
    hkv = k_buffer.shape[1]
    out = torch.empty((b, h, d), dtype=q.dtype)
    if b == 0:
        return out
    splits, piece = context_split(b if requests is None else requests, max_len, torch.get_num_threads(), piece)
    part = torch.empty(b * hkv * splits * (h // hkv) * (d + 2), dtype=torch.float32)
    kl.fn(_pool_kernel("decode_attention", k_buffer, SUFFIX[q.dtype]))(
        q=q.data_ptr(), q_stride=q.stride(0), **_pool_kwargs(k_buffer, v_buffer, k_scales, v_scales),
        table=req_to_slot.data_ptr(), table_stride=req_to_slot.stride(0), rows=req_indices.data_ptr(),
        seq_lens=seq_lens.data_ptr(), out=out.data_ptr(), B=b, H=h, Hkv=hkv, D=d, scale=sm_scale, splits=splits,
        piece=piece, part=part.data_ptr())
    return out


# ------------------------------------------------------------------------------------- extend attention


def extend_attention_supported(kl: CKernels | None, dtype: torch.dtype, head_dim: int) -> bool:
    return kl is not None and kl.has_decode_step and dtype == torch.bfloat16 and head_dim % 32 == 0 \
        and head_dim <= 128


def extend_attention(q: torch.Tensor, k_buffer: torch.Tensor, v_buffer: torch.Tensor, req_to_slot: torch.Tensor,
                     req_indices: torch.Tensor, prefix_lens: torch.Tensor, extend_lens: torch.Tensor,
                     sm_scale: float, *, k_scales: torch.Tensor | None = None, v_scales: torch.Tensor | None = None,
                     kl: CKernels | None = None) -> torch.Tensor:
    """Like radixgen.kernels.extend_attention, for bfloat16 CPU tensors (head_dim a multiple of 32, at most
    128, AVX512-BF16): q (T, Hq, D) holds the B requests' new tokens back to back (rows may be strided);
    request b's tokens sit at positions prefix_lens[b] .. + extend_lens[b] - 1 and their K/V are already in
    the pool (bf16, or 8-bit codes with k_scales / v_scales) through row req_indices[b] of req_to_slot.
    Returns (T, Hq, D)."""
    _check_attention_pool(q, k_buffer, v_buffer, k_scales, v_scales, (torch.bfloat16,))
    for name, t in (("req_indices", req_indices), ("prefix_lens", prefix_lens), ("extend_lens", extend_lens)):
        check_tensor(name, t, 1, (torch.int64,))
        check_dim(name, t, 0, req_indices.shape[0], "batch")
    check_tensor("req_to_slot", req_to_slot, 2, (torch.int64,))
    expect(req_to_slot.stride(1) == 1, "req_to_slot rows must be contiguous")
    _check_cpu(q=q, k_buffer=k_buffer, v_buffer=v_buffer, req_to_slot=req_to_slot)
    expect(int(extend_lens.sum()) == q.shape[0], f"extend_lens sum to {int(extend_lens.sum())}, q has {q.shape[0]}")
    expect(bool((extend_lens >= 1).all()) and bool((prefix_lens >= 0).all()), "extend_lens >= 1, prefix_lens >= 0")
    expect(int((prefix_lens + extend_lens).max()) <= req_to_slot.shape[1], "sequences exceed req_to_slot's columns")
    kl = _require(kl)
    expect(extend_attention_supported(kl, q.dtype, q.shape[2]),
           "the CPU extend kernel needs AVX512-BF16 and a head_dim that is a multiple of 32, at most 128")
    return _extend_attention(kl, q, k_buffer, v_buffer, req_to_slot, req_indices.contiguous(),
                             prefix_lens.tolist(), extend_lens.tolist(), float(sm_scale), k_scales, v_scales)


def _extend_attention(kl: CKernels, q, k_buffer, v_buffer, req_to_slot, req_indices, prefix_lens: list[int],
                      extend_lens: list[int], sm_scale: float, k_scales=None, v_scales=None) -> torch.Tensor:
    t, h, d = q.shape
    hkv = k_buffer.shape[1]
    out = torch.empty((t, h, d), dtype=q.dtype)
    starts, total = [], 0
    for e in extend_lens:
        starts.append(total)
        total += e
    pack_len = sum(hkv * 2 * -(-(p + e) // 16) * 16 * d for p, e in zip(prefix_lens, extend_lens, strict=True))
    pack = torch.empty(pack_len, dtype=torch.bfloat16)
    p_t = torch.tensor(prefix_lens, dtype=torch.int64)
    e_t = torch.tensor(extend_lens, dtype=torch.int64)
    s_t = torch.tensor(starts, dtype=torch.int64)
    kl.fn(_pool_kernel("extend_attention", k_buffer, "bf16"))(
        q=q.data_ptr(), q_stride=q.stride(0), **_pool_kwargs(k_buffer, v_buffer, k_scales, v_scales),
        table=req_to_slot.data_ptr(), table_stride=req_to_slot.stride(0), rows=req_indices.data_ptr(),
        prefix_lens=p_t.data_ptr(), extend_lens=e_t.data_ptr(), q_start=s_t.data_ptr(), out=out.data_ptr(),
        B=len(extend_lens), H=h, Hkv=hkv, D=d, scale=sm_scale, pack=pack.data_ptr())
    return out


# ------------------------------------------------------------------------------------------ elementwise


def _check_rows(name: str, t: torch.Tensor, dtype: torch.dtype | None = None) -> None:
    check_tensor(name, t, 2, (dtype,) if dtype else DTYPES)
    expect(t.stride(1) == 1, f"{name} must have unit stride along its last dim, got strides {t.stride()}")


def add_rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None, *,
                kl: CKernels | None = None) -> torch.Tensor:
    """rmsnorm(x [+ residual]) * weight for x (T, N); with `residual` (T, N contiguous) the sum is stored
    into `residual` in place. Returns a new (T, N) tensor."""
    _check_rows("x", x)
    check_tensor("weight", weight, 1, (x.dtype,))
    check_contiguous("weight", weight)
    check_dim("weight", weight, 0, x.shape[1], "hidden size")
    if residual is not None:
        _check_rows("residual", residual, x.dtype)
        check_contiguous("residual", residual)
        expect(residual.shape == x.shape, f"residual shape {tuple(residual.shape)} != x shape {tuple(x.shape)}")
    expect(eps > 0, f"eps must be positive, got {eps!r}")
    _check_cpu(x=x, weight=weight, **({"residual": residual} if residual is not None else {}))
    return _add_rmsnorm(_require(kl), x, weight, float(eps), residual)


def _add_rmsnorm(kl: CKernels, x, weight, eps: float, residual) -> torch.Tensor:
    out = torch.empty(x.shape, dtype=x.dtype)
    kl.fn("add_rmsnorm", SUFFIX[x.dtype])(
        x=x.data_ptr(), x_stride=x.stride(0), residual=_ptr(residual), weight=weight.data_ptr(), out=out.data_ptr(),
        n_rows=x.shape[0], N=x.shape[1], eps=eps)
    return out


def silu_and_mul(x: torch.Tensor, *, kl: CKernels | None = None) -> torch.Tensor:
    """(T, 2N) gate|up, bfloat16, contiguous -> (T, N) silu(gate) * up (AVX512-BF16 CPUs)."""
    _check_rows("x", x, torch.bfloat16)
    check_contiguous("x", x)
    expect(x.shape[1] % 2 == 0, f"x's last dim must be even (gate|up), got {x.shape[1]}")
    _check_cpu(x=x)
    kl = _require(kl)
    expect(kl.has_decode_step, "the CPU SiLU kernel needs AVX512-BF16")
    return _silu_and_mul(kl, x)


def _silu_and_mul(kl: CKernels, x: torch.Tensor) -> torch.Tensor:
    n = x.shape[1] // 2
    out = torch.empty((x.shape[0], n), dtype=x.dtype)
    kl.fn("rg_silu_and_mul_bf16")(gu=x.data_ptr(), out=out.data_ptr(), M=x.shape[0], I=n)
    return out


def silu_and_mul_ref(x: torch.Tensor) -> torch.Tensor:
    gate, up = x.chunk(2, dim=-1)
    return torch.nn.functional.silu(gate) * up


def rotary_(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos_sin_cache: torch.Tensor, *,
            kl: CKernels | None = None) -> None:
    """Rotate-half rotary embedding in place on q (T, Hq, D) and k (T, Hk, D) (rows may be strided, heads
    and dims contiguous); cos_sin_cache (P, D) float32 holds cos in its first D/2 columns, sin in the rest."""
    check_tensor("positions", positions, 1, (torch.int64,))
    check_tensor("q", q, 3, DTYPES)
    check_tensor("k", k, 3, (q.dtype,))
    check_tensor("cos_sin_cache", cos_sin_cache, 2, (torch.float32,))
    check_contiguous("cos_sin_cache", cos_sin_cache)
    d = q.shape[2]
    expect(d % 2 == 0 and k.shape[2] == d and cos_sin_cache.shape[1] == d,
           f"q, k and cos_sin_cache must share an even head_dim, got {d}, {k.shape[2]}, {cos_sin_cache.shape[1]}")
    for name, t in (("q", q), ("k", k)):
        check_dim(name, t, 0, positions.shape[0], "one row per position")
        expect(t.stride(2) == 1 and t.stride(1) == d, f"{name} heads and dims must be contiguous")
    _check_cpu(positions=positions, q=q, k=k, cos_sin_cache=cos_sin_cache)
    positions = positions.contiguous()
    expect(positions.numel() == 0 or (int(positions.min()) >= 0 and int(positions.max()) < cos_sin_cache.shape[0]),
           f"positions must lie in [0, {cos_sin_cache.shape[0]})")
    _rotary(_require(kl), positions, q, k, cos_sin_cache)


def _rotary(kl: CKernels, positions, q, k, cos_sin_cache) -> None:
    kl.fn("rotary", SUFFIX[q.dtype])(
        positions=positions.data_ptr(), q=q.data_ptr(), q_stride=q.stride(0), Hq=q.shape[1], k=k.data_ptr(),
        k_stride=k.stride(0), Hk=k.shape[1], cos_sin=cos_sin_cache.data_ptr(), D=q.shape[2], n_tok=q.shape[0])
