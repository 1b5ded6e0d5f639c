"""CPU kernels in C (csrc/cpu_kernels.c), built on first use with the system C compiler and called through
ctypes: decode attention through the slot table, KV store, fused residual-add RMSNorm and in-place rotary
embedding, for float32 and bfloat16 CPU tensors; and, on CPUs with AVX512-BF16, the fused bf16 decode step
(`decode_step`: every decoder layer of a small decode batch in one call, see radixgen.runtime.cpu_decode).

They exist because on a small CPU a decode step is dominated by per-op overhead and by copies (gathering a
batch's KV into contiguous tensors before scaled_dot_product_attention); each kernel here is one call that
reads the pool in place. The build is cached under ~/.cache/radixgen/kernels (RADIXGEN_KERNEL_CACHE
overrides), keyed by the source, the flags and the CPU. When no compiler is found or the build fails,
`available()` is False and callers use their torch path; RADIXGEN_DISABLE_CPU_KERNELS=1 forces that.

Each public function checks its arguments; its torch reference is the one of the Triton kernel of the same job
(store_kv_ref, decode_attention_ref, fused_add_rmsnorm_ref, rotary_embedding_ref_). The runtime calls the
unchecked `_name(lib(), ...)` entry points on its hot path.
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

import torch

from ._checks import check_contiguous, check_dim, check_tensor, expect

logger = logging.getLogger(__name__)

_SRC_DIR = Path(__file__).parent / "csrc"
_SOURCES = ("cpu_kernels.c", "cpu_kernels_impl.h")
_FLAGS = ("-O3", "-march=native", "-fopenmp", "-fno-math-errno", "-fno-trapping-math", "-shared", "-fPIC")
_SUFFIX = {torch.float32: "f32", torch.bfloat16: "bf16"}
DTYPES = tuple(_SUFFIX)

_P, _I, _F = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float
_SIGNATURES = {
    "store_kv": [_P, _I, _P, _I, _P, _P, _P, _I, _I],
    "decode_attention": [_P, _I, _P, _P, _P, _I, _P, _P, _P, _I, _I, _I, _I, _F, _I, _P],
    "add_rmsnorm": [_P, _I, _P, _P, _P, _I, _I, _F],
    "rotary": [_P, _P, _I, _I, _P, _I, _I, _P, _I, _I],
}

_lock = threading.Lock()
_lib: CKernels | None = None
_failed: str | None = None
_enabled = True


class LayerBF16(ctypes.Structure):
    """One decoder layer for the fused decode step (rg_layer_bf16): weight and KV buffer addresses."""

    _fields_ = [(name, ctypes.c_void_p) for name in ("input_norm", "qkv", "qkv_bias", "o", "post_norm", "gate_up",
                                                     "down", "k_buf", "v_buf", "q_norm", "k_norm")]


class CKernels:
    """The loaded library: `fn(name, dtype)` is the ctypes function of that kernel for that dtype."""

    def __init__(self, path: Path) -> None:
        self.cdll = ctypes.CDLL(str(path))
        self.d_max = self.cdll.rg_d_max()
        self._fns = {}
        for name, argtypes in _SIGNATURES.items():
            for dtype, suffix in _SUFFIX.items():
                f = getattr(self.cdll, f"rg_{name}_{suffix}")
                f.argtypes, f.restype = argtypes, None
                self._fns[name, dtype] = f
        self.has_decode_step = bool(self.cdll.rg_has_decode_step())
        if self.has_decode_step:
            f = self.cdll.rg_decode_step_bf16
            f.argtypes = [ctypes.POINTER(LayerBF16), _I, _P, _P, _I, _P, _P, _P, _I, _I, _I, _I, _I, _I, _F, _F, _P,
                          _P, _P, _P, _I, _P, _I, _P, _P, _P, _P, _P, _P, _P, _P]
            f.restype = ctypes.c_int
            self.decode_step_bf16 = f
            self.pack_kpairs_bf16 = self.cdll.rg_pack_kpairs_bf16
            self.pack_kpairs_bf16.argtypes, self.pack_kpairs_bf16.restype = [_P, _I, _I, _P], None
            self.gemv_kpairs_bf16 = self.cdll.rg_gemv_kpairs_bf16
            self.gemv_kpairs_bf16.argtypes, self.gemv_kpairs_bf16.restype = [_P, _I, _I, _P, _P, _I], None
            self.extend_attention_bf16 = self.cdll.rg_extend_attention_bf16
            self.extend_attention_bf16.argtypes = [_P, _I, _P, _P, _P, _I, _P, _P, _P, _P, _P, _I, _I, _I, _I, _F,
                                                   _P]
            self.extend_attention_bf16.restype = ctypes.c_int
            self.silu_and_mul_bf16 = self.cdll.rg_silu_and_mul_bf16
            self.silu_and_mul_bf16.argtypes, self.silu_and_mul_bf16.restype = [_P, _P, _I, _I], None

    def fn(self, name: str, dtype: torch.dtype):
        return self._fns[name, dtype]


def _cache_dir() -> Path:
    root = os.environ.get("RADIXGEN_KERNEL_CACHE") or Path.home() / ".cache" / "radixgen" / "kernels"
    return Path(root)


def _build_key(cc: str) -> str:
    h = hashlib.sha256()
    for name in _SOURCES:
        h.update((_SRC_DIR / name).read_bytes())
    h.update(" ".join((cc, *_FLAGS)).encode())
    h.update(platform.machine().encode())
    try:  # -march=native: a different CPU needs a different build
        h.update(next(line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags"))
                 .encode())
    except (OSError, StopIteration):
        pass
    return h.hexdigest()[:16]


def _build() -> Path:
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        raise RuntimeError("no C compiler found (cc/gcc); set CC")
    out = _cache_dir() / f"cpu_kernels-{_build_key(cc)}.so"
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    # build into a temporary name and rename: concurrent builders (test workers, server processes) never
    # load a half-written library
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=out.parent)
    os.close(fd)
    cmd = [cc, *_FLAGS, "-o", tmp, str(_SRC_DIR / "cpu_kernels.c")]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True)
        error = proc.stderr[-2000:] if proc.returncode != 0 else None
    except OSError as exc:
        error = str(exc)
    if error is not None:
        os.unlink(tmp)
        raise RuntimeError(f"building the CPU kernels failed ({' '.join(cmd)}):\n{error}")
    os.replace(tmp, out)
    return out


def lib() -> CKernels | None:
    """The loaded kernels, building them on the first call; None when disabled or the build failed."""
    global _lib, _failed
    if not _enabled:
        return None
    if _lib is not None or _failed is not None:
        return _lib
    with _lock:
        if _lib is None and _failed is None:
            if os.environ.get("RADIXGEN_DISABLE_CPU_KERNELS", "") not in ("", "0"):
                _failed = "disabled by RADIXGEN_DISABLE_CPU_KERNELS"
            else:
                try:
                    _lib = CKernels(_build())
                except (RuntimeError, OSError) as exc:
                    _failed = str(exc)
                    logger.warning("CPU kernels unavailable, using the torch path: %s", exc)
    return _lib


@contextlib.contextmanager
def disabled():
    """Within this block `lib()` is None, so callers take their torch path (tests compare the two)."""
    global _enabled
    before, _enabled = _enabled, False
    try:
        yield
    finally:
        _enabled = before


def for_tensor(t: torch.Tensor) -> CKernels | None:
    """The kernels when they apply to `t` (a float32 or bfloat16 CPU tensor), else None."""
    if not t.is_cpu or t.dtype not in _SUFFIX:
        return None
    return lib()


def available() -> bool:
    return lib() is not None


def unavailable_reason() -> str | None:
    lib()
    return _failed


def _require() -> CKernels:
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
             v: torch.Tensor) -> None:
    """Write k/v (T, Hkv, D) (rows may be strided; heads and dims contiguous) into the buffers at `slots`."""
    check_tensor("k_buffer", k_buffer, 3, DTYPES)
    check_contiguous("k_buffer", k_buffer)
    check_contiguous("v_buffer", v_buffer)
    expect(v_buffer.shape == k_buffer.shape and v_buffer.dtype == k_buffer.dtype,
           "v_buffer must match k_buffer's shape and dtype")
    check_tensor("slots", slots, 1, (torch.int64,))
    for name, t in (("k", k), ("v", v)):
        check_tensor(name, t, 3, (k_buffer.dtype,))
        check_dim(name, t, 0, slots.shape[0], "one row per slot")
        expect(t.shape[1:] == k_buffer.shape[1:], f"{name} rows must be {tuple(k_buffer.shape[1:])}")
        expect(t.stride(2) == 1 and t.stride(1) == t.shape[2], f"{name} heads and dims must be contiguous")
    _check_cpu(k_buffer=k_buffer, v_buffer=v_buffer, slots=slots, k=k, v=v)
    slots = slots.contiguous()
    expect(slots.numel() == 0 or (int(slots.min()) >= 0 and int(slots.max()) < k_buffer.shape[0]),
           f"slots must lie in [0, {k_buffer.shape[0]})")
    _store_kv(_require(), k_buffer, v_buffer, slots, k, v)


def _store_kv(kl: CKernels, k_buffer, v_buffer, slots, k, v) -> None:
    kl.fn("store_kv", k_buffer.dtype)(k.data_ptr(), k.stride(0), v.data_ptr(), v.stride(0), k_buffer.data_ptr(),
                                      v_buffer.data_ptr(), slots.data_ptr(), slots.shape[0],
                                      k_buffer.shape[1] * k_buffer.shape[2])


# ------------------------------------------------------------------------------------- decode attention


def num_splits(batch: int, max_len: int, threads: int) -> int:
    """Pieces per request along the context: at least 4 work items per thread when the contexts allow it,
    no piece shorter than 64 positions."""
    if batch >= 4 * threads:
        return 1
    return max(1, min(-(-4 * threads // batch), max_len // 64))


def decode_attention(q: torch.Tensor, k_buffer: torch.Tensor, v_buffer: torch.Tensor, req_to_slot: torch.Tensor,
                     req_indices: torch.Tensor, seq_lens: torch.Tensor, sm_scale: float) -> torch.Tensor:
    """q (B, Hq, D) (rows may be strided) -> o (B, Hq, D): request b attends to the first seq_lens[b] slots
    of row req_indices[b] of req_to_slot (R, C), int64 everywhere."""
    check_tensor("q", q, 3, DTYPES)
    for name, t in (("k_buffer", k_buffer), ("v_buffer", v_buffer)):
        check_tensor(name, t, 3, (q.dtype,))
        check_contiguous(name, t)
        check_dim(name, t, 2, q.shape[2], "head_dim")
    expect(q.shape[1] % k_buffer.shape[1] == 0, f"query heads ({q.shape[1]}) must be a multiple of KV heads "
           f"({k_buffer.shape[1]})")
    expect(q.stride(2) == 1 and q.stride(1) == q.shape[2], "q heads and dims must be contiguous")
    check_tensor("req_to_slot", req_to_slot, 2, (torch.int64,))
    expect(req_to_slot.stride(1) == 1, "req_to_slot rows must be contiguous")
    check_tensor("req_indices", req_indices, 1, (torch.int64,))
    check_tensor("seq_lens", seq_lens, 1, (torch.int64,))
    check_dim("req_indices", req_indices, 0, q.shape[0], "batch")
    check_dim("seq_lens", seq_lens, 0, q.shape[0], "batch")
    expect(isinstance(sm_scale, (int, float)) and sm_scale > 0, f"sm_scale must be positive, got {sm_scale!r}")
    _check_cpu(q=q, k_buffer=k_buffer, v_buffer=v_buffer, req_to_slot=req_to_slot, req_indices=req_indices,
               seq_lens=seq_lens)
    kl = _require()
    expect(q.shape[2] <= kl.d_max, f"head_dim {q.shape[2]} exceeds {kl.d_max}")
    if q.shape[0]:
        expect(int(seq_lens.min()) >= 1 and int(seq_lens.max()) <= req_to_slot.shape[1],
               f"seq_lens must lie in [1, {req_to_slot.shape[1]}]")
        expect(int(req_indices.min()) >= 0 and int(req_indices.max()) < req_to_slot.shape[0],
               f"req_indices must lie in [0, {req_to_slot.shape[0]})")
    return _decode_attention(kl, q, k_buffer, v_buffer, req_to_slot, req_indices.contiguous(),
                             seq_lens.contiguous(), float(sm_scale), int(seq_lens.max()) if q.shape[0] else 0)


def _decode_attention(kl: CKernels, q, k_buffer, v_buffer, req_to_slot, req_indices, seq_lens, sm_scale: float,
                      max_len: int) -> torch.Tensor:
    b, h, d = q.shape
    hkv = k_buffer.shape[1]
    out = torch.empty((b, h, d), dtype=q.dtype)
    if b == 0:
        return out
    splits = num_splits(b, max_len, torch.get_num_threads())
    part = torch.empty(b * hkv * splits * (h // hkv) * (d + 2), dtype=torch.float32)
    kl.fn("decode_attention", q.dtype)(
        q.data_ptr(), q.stride(0), k_buffer.data_ptr(), v_buffer.data_ptr(), req_to_slot.data_ptr(),
        req_to_slot.stride(0), req_indices.data_ptr(), seq_lens.data_ptr(), out.data_ptr(), b, h, hkv, d,
        sm_scale, splits, part.data_ptr())
    return out


# ------------------------------------------------------------------------------------- extend attention


def extend_attention_supported(kl: CKernels | None, dtype: torch.dtype, head_dim: int) -> bool:
    return kl is not None and kl.has_decode_step and dtype == torch.bfloat16 and head_dim % 32 == 0 \
        and head_dim <= 128


def extend_attention(q: torch.Tensor, k_buffer: torch.Tensor, v_buffer: torch.Tensor, req_to_slot: torch.Tensor,
                     req_indices: torch.Tensor, prefix_lens: torch.Tensor, extend_lens: torch.Tensor,
                     sm_scale: float) -> torch.Tensor:
    """Like radixgen.kernels.extend_attention, for bfloat16 CPU tensors (head_dim a multiple of 32, at most
    128, AVX512-BF16): q (T, Hq, D) holds the B requests' new tokens back to back (rows may be strided);
    request b's tokens sit at positions prefix_lens[b] .. + extend_lens[b] - 1 and their K/V are already in
    the pool through row req_indices[b] of req_to_slot. Returns (T, Hq, D)."""
    check_tensor("q", q, 3, (torch.bfloat16,))
    expect(q.stride(2) == 1 and q.stride(1) == q.shape[2], "q heads and dims must be contiguous")
    for name, t in (("k_buffer", k_buffer), ("v_buffer", v_buffer)):
        check_tensor(name, t, 3, (torch.bfloat16,))
        check_contiguous(name, t)
        check_dim(name, t, 2, q.shape[2], "head_dim")
    expect(q.shape[1] % k_buffer.shape[1] == 0, "query heads must be a multiple of KV heads")
    for name, t in (("req_indices", req_indices), ("prefix_lens", prefix_lens), ("extend_lens", extend_lens)):
        check_tensor(name, t, 1, (torch.int64,))
        check_dim(name, t, 0, req_indices.shape[0], "batch")
    check_tensor("req_to_slot", req_to_slot, 2, (torch.int64,))
    expect(req_to_slot.stride(1) == 1, "req_to_slot rows must be contiguous")
    _check_cpu(q=q, k_buffer=k_buffer, v_buffer=v_buffer, req_to_slot=req_to_slot)
    expect(int(extend_lens.sum()) == q.shape[0], f"extend_lens sum to {int(extend_lens.sum())}, q has {q.shape[0]}")
    expect(bool((extend_lens >= 1).all()) and bool((prefix_lens >= 0).all()), "extend_lens >= 1, prefix_lens >= 0")
    expect(int((prefix_lens + extend_lens).max()) <= req_to_slot.shape[1], "sequences exceed req_to_slot's columns")
    kl = lib()
    expect(extend_attention_supported(kl, q.dtype, q.shape[2]),
           "the CPU extend kernel needs AVX512-BF16 and a head_dim that is a multiple of 32, at most 128")
    return _extend_attention(kl, q, k_buffer, v_buffer, req_to_slot, req_indices.contiguous(),
                             prefix_lens.tolist(), extend_lens.tolist(), float(sm_scale))


def _extend_attention(kl: CKernels, q, k_buffer, v_buffer, req_to_slot, req_indices, prefix_lens: list[int],
                      extend_lens: list[int], sm_scale: float) -> torch.Tensor:
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
    kl.extend_attention_bf16(q.data_ptr(), q.stride(0), k_buffer.data_ptr(), v_buffer.data_ptr(),
                             req_to_slot.data_ptr(), req_to_slot.stride(0), req_indices.data_ptr(), p_t.data_ptr(),
                             e_t.data_ptr(), s_t.data_ptr(), out.data_ptr(), len(extend_lens), h, hkv, d, sm_scale,
                             pack.data_ptr())
    return out


# ------------------------------------------------------------------------------------------ elementwise


def _check_rows(name: str, t: torch.Tensor, dtype: torch.dtype | None = None) -> None:
    check_tensor(name, t, 2, (dtype,) if dtype else DTYPES)
    expect(t.stride(1) == 1, f"{name} must have unit stride along its last dim, got strides {t.stride()}")


def add_rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float,
                residual: torch.Tensor | None = None) -> torch.Tensor:
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
    return _add_rmsnorm(_require(), x, weight, float(eps), residual)


def _add_rmsnorm(kl: CKernels, x, weight, eps: float, residual) -> torch.Tensor:
    out = torch.empty(x.shape, dtype=x.dtype)
    kl.fn("add_rmsnorm", x.dtype)(x.data_ptr(), x.stride(0), _ptr(residual), weight.data_ptr(), out.data_ptr(),
                                  x.shape[0], x.shape[1], eps)
    return out


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """(T, 2N) gate|up, bfloat16, contiguous -> (T, N) silu(gate) * up (AVX512-BF16 CPUs)."""
    _check_rows("x", x, torch.bfloat16)
    check_contiguous("x", x)
    expect(x.shape[1] % 2 == 0, f"x's last dim must be even (gate|up), got {x.shape[1]}")
    _check_cpu(x=x)
    kl = _require()
    expect(kl.has_decode_step, "the CPU SiLU kernel needs AVX512-BF16")
    return _silu_and_mul(kl, x)


def _silu_and_mul(kl: CKernels, x: torch.Tensor) -> torch.Tensor:
    n = x.shape[1] // 2
    out = torch.empty((x.shape[0], n), dtype=x.dtype)
    kl.silu_and_mul_bf16(x.data_ptr(), out.data_ptr(), x.shape[0], n)
    return out


def silu_and_mul_ref(x: torch.Tensor) -> torch.Tensor:
    gate, up = x.chunk(2, dim=-1)
    return torch.nn.functional.silu(gate) * up


def rotary_(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos_sin_cache: torch.Tensor) -> None:
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
    _rotary(_require(), positions, q, k, cos_sin_cache)


def _rotary(kl: CKernels, positions, q, k, cos_sin_cache) -> None:
    kl.fn("rotary", q.dtype)(positions.data_ptr(), q.data_ptr(), q.stride(0), q.shape[1], k.data_ptr(),
                             k.stride(0), k.shape[1], cos_sin_cache.data_ptr(), q.shape[2], q.shape[0])


# ------------------------------------------------------------------------------------ fused decode step


class DecodeStepWeights:
    """The weights of a Llama-family decoder stack laid out for `decode_step`: norm weights (optionally per-head
    q/k norms, Qwen3) and the qkv bias as given (bf16), the four matmul weights and the optional LM head
    (vocab, hidden) packed into the K-pair layout of csrc/cpu_kernels.c (a copy, built here), the KV buffers by
    address. The given norms, bias and KV buffers must stay alive and in place as long as this object is used
    (the model's parameters and pool do)."""

    MATMULS = ("qkv", "o", "gate_up", "down")

    def __init__(self, kl: CKernels, layers: list[dict[str, torch.Tensor | None]], final_norm: torch.Tensor, *,
                 num_heads: int, num_kv_heads: int, head_dim: int, intermediate: int, eps: float,
                 lm_head: torch.Tensor | None = None) -> None:
        expect(kl.has_decode_step, "this CPU build has no fused decode step (needs AVX512-BF16)")
        hidden = final_norm.shape[0]
        qkv_n = (num_heads + 2 * num_kv_heads) * head_dim
        expect(num_heads % num_kv_heads == 0, "num_heads must be a multiple of num_kv_heads")
        expect(hidden % 2 == 0 and (num_heads * head_dim) % 2 == 0 and intermediate % 2 == 0,
               "hidden size, query size and intermediate size must be even (the K-pair layout)")
        shapes = {"input_norm": (hidden,), "qkv": (qkv_n, hidden), "qkv_bias": (qkv_n,),
                  "o": (hidden, num_heads * head_dim), "post_norm": (hidden,), "gate_up": (2 * intermediate, hidden),
                  "down": (hidden, intermediate), "q_norm": (head_dim,), "k_norm": (head_dim,)}
        optional = ("qkv_bias", "q_norm", "k_norm")
        arr = (LayerBF16 * len(layers))()
        self.packed: list[torch.Tensor] = []
        for i, ly in enumerate(layers):
            for name, shape in shapes.items():
                t = ly.get(name)
                if t is None and name in optional:
                    continue
                expect(t is not None and tuple(t.shape) == shape and t.dtype == torch.bfloat16 and t.is_contiguous()
                       and t.is_cpu, f"layer {i} {name}: expected a contiguous CPU bfloat16 tensor of shape {shape}")
                if name in self.MATMULS:
                    t = self._pack(kl, t)
                setattr(arr[i], name, t.data_ptr())
            for name in ("k_buf", "v_buf"):
                t = ly[name]
                expect(t.dtype == torch.bfloat16 and t.is_contiguous() and t.shape[1:] == (num_kv_heads, head_dim),
                       f"layer {i} {name}: expected a contiguous bfloat16 (slots, {num_kv_heads}, {head_dim}) pool")
                setattr(arr[i], name, t.data_ptr())
        self.vocab = 0
        self.lm_head: torch.Tensor | None = None
        if lm_head is not None:
            expect(lm_head.dim() == 2 and lm_head.shape[1] == hidden and lm_head.dtype == torch.bfloat16
                   and lm_head.is_contiguous() and lm_head.is_cpu,
                   f"lm_head: expected a contiguous CPU bfloat16 tensor of shape (vocab, {hidden})")
            self.vocab, self.lm_head = lm_head.shape[0], self._pack(kl, lm_head)
        self.layers, self.final_norm = arr, final_norm
        self.keep = (layers, final_norm)
        self.hidden, self.num_heads, self.num_kv_heads, self.head_dim = hidden, num_heads, num_kv_heads, head_dim
        self.intermediate, self.eps = intermediate, float(eps)
        self._scratch: dict[tuple[int, int], tuple] = {}

    def scratch(self, m: int, splits: int) -> tuple:
        """decode_step's buffers for m rows: (x, out, res_a, res_b, qkv, attn, gu, part, logits), kept from one
        step to the next (a step's outputs are valid until the next step with as many rows)."""
        key = (m, splits)
        if key not in self._scratch:
            bf, h, hkv, d = torch.bfloat16, self.num_heads, self.num_kv_heads, self.head_dim
            if len(self._scratch) >= 8:
                self._scratch.clear()
            self._scratch[key] = (
                *(torch.empty((m, self.hidden), dtype=bf) for _ in range(4)),
                torch.empty((m, (h + 2 * hkv) * d), dtype=bf), torch.empty((m, h * d), dtype=bf),
                torch.empty((m, 2 * self.intermediate), dtype=bf),
                torch.empty(m * hkv * splits * (h // hkv) * (d + 2), dtype=torch.float32),
                None if self.lm_head is None else torch.empty((m, self.vocab), dtype=torch.float32))
        return self._scratch[key]

    def _pack(self, kl: CKernels, w: torch.Tensor) -> torch.Tensor:
        n, k = w.shape
        packed = torch.empty((n + 15) // 16 * 16 * k, dtype=torch.bfloat16)
        kl.pack_kpairs_bf16(w.data_ptr(), n, k, packed.data_ptr())
        self.packed.append(packed)
        return packed


def decode_step(kl: CKernels, w: DecodeStepWeights, embed: torch.Tensor, ids: torch.Tensor, positions: torch.Tensor,
                cos_sin_cache: torch.Tensor, out_slots: torch.Tensor, req_to_slot: torch.Tensor,
                req_indices: torch.Tensor, max_len: int,
                scale: float) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Every decoder layer and the final norm for a decode batch of M tokens `ids` at `positions` (each request's
    context being its position + 1, this token included), from their rows of `embed` (vocab, hidden) bf16 ->
    ((M, hidden) final hidden states, (M, vocab) float32 logits, rounded to bf16, or None where `w` has no LM
    head), both in `w`'s buffers for M rows, valid until its next step with M rows. max_len: the longest
    context. Index tensors int64 and contiguous, no checks: the runtime builds them. Writes this step's K/V
    into the pool at out_slots."""
    m = ids.shape[0]
    h, hkv, d = w.num_heads, w.num_kv_heads, w.head_dim
    splits = num_splits(m, max_len, torch.get_num_threads())
    x, out, res_a, res_b, qkv, attn, gu, part, logits = w.scratch(m, splits)
    kl.decode_step_bf16(w.layers, len(w.layers), w.final_norm.data_ptr(), _ptr(w.lm_head), w.vocab, _ptr(logits),
                        embed.data_ptr(), ids.data_ptr(), m, w.hidden, h, hkv, d, w.intermediate, w.eps, scale,
                        positions.data_ptr(), cos_sin_cache.data_ptr(), out_slots.data_ptr(), req_to_slot.data_ptr(),
                        req_to_slot.stride(0), req_indices.data_ptr(), splits, x.data_ptr(), out.data_ptr(),
                        res_a.data_ptr(), res_b.data_ptr(), qkv.data_ptr(), attn.data_ptr(), gu.data_ptr(),
                        part.data_ptr())
    return out, logits


def lm_head_logits(kl: CKernels, w: DecodeStepWeights, hidden: torch.Tensor) -> torch.Tensor:
    """(M, hidden) bf16 final hidden states -> (M, vocab) float32 logits (rounded to bf16, as the fused step's)
    on `w`'s K-pair packed LM head, which it must have."""
    expect(w.lm_head is not None, "these decode-step weights have no LM head")
    check_tensor("hidden", hidden, 2, (torch.bfloat16,))
    expect(hidden.shape[1] == w.hidden, f"hidden: expected {w.hidden} columns, got {hidden.shape[1]}")
    hidden = hidden.contiguous()
    out = torch.empty((hidden.shape[0], w.vocab), dtype=torch.float32)
    kl.gemv_kpairs_bf16(hidden.data_ptr(), hidden.shape[0], w.hidden, w.lm_head.data_ptr(), out.data_ptr(), w.vocab)
    return out
