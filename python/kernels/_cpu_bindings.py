"""The C kernels' entry points, each declared once: name -> (C return type, [(argument name, C type)]).

The ctypes argtypes and restype of every function come from this table, and every call passes its arguments
by name (`bind` makes each a keyword-only Python function, so an argument left out, misspelt or given twice is
a TypeError instead of memory silently read at the wrong place). tests/kernels/test_cpu_bindings.py parses the
prototypes of csrc/cpu_kernels.c, preprocessed for each instruction set (stubs included), and checks this
table against them: name, arity, and the C type and name of every argument.

Kernels that can fail return `rg_status` (0: success); a call that gets anything else raises CKernelError.
`libc_function` binds a function of the C library itself (malloc settings, madvise).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
from pathlib import Path


def libc_function(name: str):
    """The C library's function `name` (untyped: set its argtypes where they are not all int), or None where there
    is no such function (not glibc, not Linux)."""
    try:
        return getattr(ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6"), name)
    except (OSError, AttributeError):
        return None


# the element type of the dtype-generic kernels (csrc/cpu_kernels_impl.h's T), by name suffix
ELEMENT_TYPES = {"f32": "float", "bf16": "uint16_t"}

# the code type of an 8-bit KV pool's kernels, by the name suffix before the dtype's (csrc/cpu_pool_impl.h)
KV_CODE_TYPES = {"i8": "int8_t", "f8": "uint8_t"}


def _quantized_pool_kernels(code: str, c_type: str):
    """The store, decode and extend kernels over a pool of 8-bit codes with bf16 scales (slots, Hkv)."""
    pool = [("k_buf", f"const {c_type} *"), ("v_buf", f"const {c_type} *"), ("k_scale", "const uint16_t *"),
            ("v_scale", "const uint16_t *")]
    yield f"rg_store_kv_{code}_{{T}}", ("void", [
        ("k", "const T *"), ("k_stride", "int64_t"), ("v", "const T *"), ("v_stride", "int64_t"),
        *[(name, t.removeprefix("const ")) for name, t in pool], ("slots", "const int64_t *"), ("n_tok", "int64_t"),
        ("Hkv", "int64_t"), ("D", "int64_t")])
    yield f"rg_decode_attention_{code}_{{T}}", ("rg_status", [
        ("q", "const T *"), ("q_stride", "int64_t"), *pool, ("table", "const int64_t *"), ("table_stride", "int64_t"),
        ("rows", "const int64_t *"), ("seq_lens", "const int64_t *"), ("out", "T *"), ("B", "int64_t"),
        ("H", "int64_t"), ("Hkv", "int64_t"), ("D", "int64_t"), ("scale", "float"), ("splits", "int64_t"),
        ("piece", "int64_t"), ("part", "float *")])
    yield f"rg_extend_attention_{code}_bf16", ("rg_status", [  # AVX512-BF16 (a stub elsewhere)
        ("q", "const uint16_t *"), ("q_stride", "int64_t"), *pool, ("table", "const int64_t *"),
        ("table_stride", "int64_t"), ("rows", "const int64_t *"), ("prefix_lens", "const int64_t *"),
        ("extend_lens", "const int64_t *"), ("q_start", "const int64_t *"), ("out", "uint16_t *"), ("B", "int64_t"),
        ("H", "int64_t"), ("Hkv", "int64_t"), ("D", "int64_t"), ("scale", "float"), ("pack", "uint16_t *")])


_TABLE = {  # "{T}": the kernel exists once per suffix of ELEMENT_TYPES, T being that suffix's element type
    "rg_d_max": ("int", []),
    "rg_has_decode_step": ("int", []),
    "rg_store_kv_{T}": ("void", [
        ("k", "const T *"), ("k_stride", "int64_t"), ("v", "const T *"), ("v_stride", "int64_t"),
        ("k_buf", "T *"), ("v_buf", "T *"), ("slots", "const int64_t *"), ("n_tok", "int64_t"),
        ("row_elems", "int64_t")]),
    "rg_decode_attention_{T}": ("rg_status", [
        ("q", "const T *"), ("q_stride", "int64_t"), ("k_buf", "const T *"), ("v_buf", "const T *"),
        ("table", "const int64_t *"), ("table_stride", "int64_t"), ("rows", "const int64_t *"),
        ("seq_lens", "const int64_t *"), ("out", "T *"), ("B", "int64_t"), ("H", "int64_t"), ("Hkv", "int64_t"),
        ("D", "int64_t"), ("scale", "float"), ("splits", "int64_t"), ("piece", "int64_t"),
        ("part", "float *")]),
    "rg_add_rmsnorm_{T}": ("void", [
        ("x", "const T *"), ("x_stride", "int64_t"), ("residual", "T *"), ("weight", "const T *"), ("out", "T *"),
        ("n_rows", "int64_t"), ("N", "int64_t"), ("eps", "float")]),
    "rg_rotary_{T}": ("void", [
        ("positions", "const int64_t *"), ("q", "T *"), ("q_stride", "int64_t"), ("Hq", "int64_t"), ("k", "T *"),
        ("k_stride", "int64_t"), ("Hk", "int64_t"), ("cos_sin", "const float *"), ("D", "int64_t"),
        ("n_tok", "int64_t")]),
    # linear layers over a weight descriptor (csrc/cpu_linear.h), every build (AVX512-BF16 ones faster for bf16)
    "rg_linear_{T}": ("rg_status", [
        ("w", "const rg_weight *"), ("x", "const T *"), ("M", "int64_t"), ("bias", "const T *"), ("y", "T *"),
        ("yf", "float *")]),
    # the prefill GEMM on AMX tiles (csrc/cpu_linear_amx.h): AMX-BF16 builds where the OS grants the tile state
    # (rg_has_amx); elsewhere rg_has_amx is 0 and the GEMM refuses
    "rg_has_amx": ("int", []),
    "rg_linear_amx_bf16": ("rg_status", [
        ("w", "const rg_weight *"), ("x", "const uint16_t *"), ("M", "int64_t"), ("bias", "const uint16_t *"),
        ("y", "uint16_t *"), ("yf", "float *")]),
    # bf16 K-pair matmuls on vdpbf16ps or on the AVX2 float32-math kernels (csrc/cpu_linear_bf16_avx2.h)
    "rg_has_fast_bf16_linear": ("int", []),
    # expert blocks (csrc/cpu_moe.h), every build: the grouped experts over weight descriptors, the routing
    "rg_moe_experts_{T}": ("rg_status", [
        ("gate_up", "const rg_weight *"), ("down", "const rg_weight *"), ("n_local", "int64_t"), ("first", "int64_t"),
        ("x", "const T *"), ("n_tok", "int64_t"), ("H", "int64_t"), ("I", "int64_t"), ("ids", "const int32_t *"),
        ("weights", "const float *"), ("k", "int64_t"), ("out", "T *")]),
    "rg_moe_route": ("rg_status", [
        ("logits", "const float *"), ("n_tok", "int64_t"), ("E", "int64_t"), ("k", "int64_t"),
        ("softmax_before_topk", "int64_t"), ("norm_topk_prob", "int64_t"), ("ids", "int32_t *"),
        ("weights", "float *")]),
    "rg_moe_step_bytes": ("int64_t", [
        ("M", "int64_t"), ("H", "int64_t"), ("E", "int64_t"), ("k", "int64_t"), ("n_local", "int64_t"),
        ("I", "int64_t"), ("sI", "int64_t"), ("thread_bytes", "int64_t *")]),
    "rg_sum_partials_bf16": ("rg_status", [  # AVX512-BF16 (elsewhere it refuses)
        ("parts", "const float *"), ("S", "int64_t"), ("M", "int64_t"), ("N", "int64_t"), ("bias", "const uint16_t *"),
        ("out", "uint16_t *")]),
    # a grammar's token bitmask over float32 logits (csrc/cpu_bitmask.h), every build
    "rg_apply_token_bitmask_f32": ("rg_status", [
        ("logits", "float *"), ("ld", "int64_t"), ("bitmask", "const int32_t *"), ("words", "int64_t"),
        ("rows", "const int64_t *"), ("n_rows", "int64_t"), ("vocab", "int64_t")]),
    "rg_weight_rows_{T}": ("rg_status", [
        ("w", "const rg_weight *"), ("ids", "const int64_t *"), ("n", "int64_t"), ("out", "T *")]),
    **{name: decl for code, c_type in KV_CODE_TYPES.items() for name, decl in _quantized_pool_kernels(code, c_type)},
    # bfloat16 only, AVX512-BF16 (elsewhere stubs returning RG_ERR_UNSUPPORTED)
    "rg_silu_and_mul_bf16": ("rg_status", [
        ("gu", "const uint16_t *"), ("out", "uint16_t *"), ("M", "int64_t"), ("I", "int64_t")]),
    "rg_decode_step_scratch_bytes_bf16": ("int64_t", [
        ("M", "int64_t"), ("hidden", "int64_t"), ("H", "int64_t"), ("Hkv", "int64_t"), ("D", "int64_t"),
        ("inter", "int64_t"), ("max_piece", "int64_t"), ("threads", "int64_t")]),
    "rg_decode_step_bf16": ("rg_status", [
        ("layers", "const rg_layer_bf16 *"), ("n_layers", "int64_t"), ("final_norm", "const uint16_t *"),
        ("lm_head", "const rg_weight *"), ("logits", "float *"), ("embed", "const rg_weight *"),
        ("ids", "const int64_t *"), ("M", "int64_t"), ("hidden", "int64_t"), ("H", "int64_t"), ("Hkv", "int64_t"),
        ("D", "int64_t"), ("inter", "int64_t"), ("eps", "float"), ("scale", "float"),
        ("positions", "const int64_t *"), ("cos_sin", "const float *"), ("out_slots", "const int64_t *"),
        ("table", "const int64_t *"), ("table_stride", "int64_t"), ("rows", "const int64_t *"),
        ("splits", "int64_t"), ("piece", "int64_t"), ("x", "uint16_t *"), ("out", "uint16_t *"),
        ("res_a", "uint16_t *"), ("res_b", "uint16_t *"), ("qkv", "uint16_t *"), ("attn", "uint16_t *"),
        ("gu", "uint16_t *"), ("part", "float *"), ("scratch", "void *"), ("scratch_bytes", "int64_t"),
        ("threads", "int64_t"), ("par", "const rg_parallel *")]),
    "rg_lora_delta_bf16": ("rg_status", [
        ("x", "const uint16_t *"), ("K", "int64_t"), ("y", "uint16_t *"), ("N", "int64_t"), ("a", "const uint16_t *"),
        ("b", "const uint16_t *"), ("scales", "const float *"), ("ranks", "const int32_t *"),
        ("rank_stride", "int64_t"), ("R", "int64_t"), ("seg_end", "const int64_t *"), ("nseg", "int64_t"),
        ("rows", "const int64_t *"), ("start", "const int64_t *"), ("len", "const int64_t *"),
        ("slot", "const int64_t *"), ("n_groups", "int64_t"), ("h", "uint16_t *")]),
    "rg_extend_attention_bf16": ("rg_status", [
        ("q", "const uint16_t *"), ("q_stride", "int64_t"), ("k_buf", "const uint16_t *"),
        ("v_buf", "const uint16_t *"), ("table", "const int64_t *"), ("table_stride", "int64_t"),
        ("rows", "const int64_t *"), ("prefix_lens", "const int64_t *"), ("extend_lens", "const int64_t *"),
        ("q_start", "const int64_t *"), ("out", "uint16_t *"), ("B", "int64_t"), ("H", "int64_t"),
        ("Hkv", "int64_t"), ("D", "int64_t"), ("scale", "float"), ("pack", "uint16_t *")]),
    # GGUF Q4_K / Q5_K weights from their own bits (csrc/cpu_gguf_k.h), every build
    "rg_gguf_k_linear": ("rg_status", [
        ("w", "const uint8_t *"), ("kind", "int64_t"), ("N", "int64_t"), ("K", "int64_t"), ("x", "const float *"),
        ("M", "int64_t"), ("y", "float *")]),
    "rg_gguf_k_rows": ("rg_status", [
        ("w", "const uint8_t *"), ("kind", "int64_t"), ("N", "int64_t"), ("K", "int64_t"),
        ("ids", "const int64_t *"), ("n", "int64_t"), ("out", "float *")]),
    "rg_gguf_k_repack": ("rg_status", [
        ("raw", "const uint8_t *"), ("kind", "int64_t"), ("N", "int64_t"), ("K", "int64_t"), ("out", "uint8_t *")]),
    "rg_gguf_q6k_int8": ("rg_status", [
        ("raw", "const uint8_t *"), ("N", "int64_t"), ("K", "int64_t"), ("q", "int8_t *"), ("s", "float *")]),
    # GGUF Q5_0 / Q5_1 / Q2_K / Q3_K / IQ4_NL / IQ4_XS / MXFP4 weights as stored (csrc/cpu_gguf_more.h), every build
    "rg_gguf_more_linear": ("rg_status", [
        ("w", "const uint8_t *"), ("kind", "int64_t"), ("N", "int64_t"), ("K", "int64_t"), ("x", "const float *"),
        ("M", "int64_t"), ("y", "float *")]),
    "rg_gguf_more_rows": ("rg_status", [
        ("w", "const uint8_t *"), ("kind", "int64_t"), ("N", "int64_t"), ("K", "int64_t"),
        ("ids", "const int64_t *"), ("n", "int64_t"), ("out", "float *")]),
    # row copies between KV pools, every layer's buffers in one call (csrc/cpu_kv_copy.h), every build
    "rg_kv_copy_rows": ("rg_status", [
        ("src", "const void * const *"), ("dst", "void * const *"), ("n_bufs", "int64_t"),
        ("src_index", "const int64_t *"), ("dst_index", "const int64_t *"), ("n_rows", "int64_t"),
        ("row_bytes", "int64_t"), ("threads", "int64_t")]),
    "rg_kv_quantize_rows_{T}": ("rg_status", [
        ("src", "const void * const *"), ("dst", "void * const *"), ("dst_scale", "void * const *"),
        ("n_bufs", "int64_t"), ("src_index", "const int64_t *"), ("dst_index", "const int64_t *"),
        ("n_rows", "int64_t"), ("Hkv", "int64_t"), ("D", "int64_t"), ("code", "int64_t"), ("threads", "int64_t")]),
    "rg_kv_dequantize_rows_{T}": ("rg_status", [
        ("src", "const void * const *"), ("src_scale", "const void * const *"), ("dst", "void * const *"),
        ("n_bufs", "int64_t"), ("src_index", "const int64_t *"), ("dst_index", "const int64_t *"),
        ("n_rows", "int64_t"), ("Hkv", "int64_t"), ("D", "int64_t"), ("code", "int64_t"), ("threads", "int64_t")]),
    # Q4_0 / Q4_1 / Q8_0 decode rows in bf16 (csrc/cpu_gguf_q.h), every build
    "rg_gguf_q_linear_bf16": ("rg_status", [
        ("w", "const uint8_t *"), ("kind", "int64_t"), ("N", "int64_t"), ("K", "int64_t"), ("x", "const uint16_t *"),
        ("M", "int64_t"), ("y", "uint16_t *")]),
    # the deterministic mode's float32 matmul (csrc/cpu_linear_f32_fixed.h), every build
    "rg_linear_f32_fixed": ("rg_status", [
        ("w", "const float *"), ("N", "int64_t"), ("K", "int64_t"), ("x", "const float *"), ("M", "int64_t"),
        ("bias", "const float *"), ("y", "float *")]),
}


def _expand(table) -> dict[str, tuple[str, list[tuple[str, str]]]]:
    out = {}
    for name, (restype, args) in table.items():
        if "{T}" not in name:
            out[name] = (restype, list(args))
            continue
        for suffix, elem in ELEMENT_TYPES.items():
            out[name.format(T=suffix)] = (restype, [(a, " ".join(elem if w == "T" else w for w in t.split()))
                                                   for a, t in args])
    return out


DECLARATIONS = _expand(_TABLE)  # every exported C function, dtype-generic ones once per element type

STATUS = {0: "ok", 1: "a memory allocation failed", 2: "not supported by this build or these arguments",
          3: "the scratch buffer is too small"}


class CKernelError(RuntimeError):
    """A C kernel returned a failure status."""


class WeightDesc(ctypes.Structure):
    """One weight in a layout of csrc/cpu_linear.h (its rg_weight): kind, rows, columns, group, zero points, data;
    the deterministic mode's k_split and partial (0 otherwise)."""

    _fields_ = [*((name, ctypes.c_int64) for name in ("kind", "N", "K", "group", "zero_points")),
                ("data", ctypes.c_void_p), ("k_split", ctypes.c_int64), ("partial", ctypes.c_int64)]


class LayerBF16(ctypes.Structure):
    """One decoder layer for the fused decode step (csrc's rg_layer_bf16): norm weights, the qkv bias and KV buffers
    by address, the four matmul weights as descriptors, and its LoRA descriptor's address (a LoRALayerBF16, or
    None)."""

    _fields_ = [*((name, ctypes.c_void_p) for name in ("input_norm", "qkv_bias", "post_norm")),
                *((name, WeightDesc) for name in ("qkv", "o", "gate_up", "down")),
                *((name, ctypes.c_void_p) for name in ("k_buf", "v_buf", "q_norm", "k_norm", "k_scale", "v_scale")),
                ("kv_format", ctypes.c_int64),  # csrc/cpu_kv_quant.h's KV_PLAIN, KV_INT8, KV_FP8
                ("lora", ctypes.c_void_p),
                ("moe", ctypes.c_void_p)]  # a MoELayerBF16's address, or None


class MoELayerBF16(ctypes.Structure):
    """csrc/cpu_moe.h's rg_moe_layer: one expert block of the fused decode step (expert arrays by address)."""

    _fields_ = [("gate_up", ctypes.c_void_p), ("down", ctypes.c_void_p),
                *((name, ctypes.c_int64) for name in ("n_local", "first", "I", "num_experts", "top_k",
                                                        "softmax_before_topk", "norm_topk_prob")),
                ("router", WeightDesc), ("shared_gate_up", WeightDesc), ("shared_down", WeightDesc),
                ("shared_I", ctypes.c_int64), ("shared_gate", ctypes.c_void_p), ("scratch", ctypes.c_void_p),
                ("thread_scratch", ctypes.c_void_p), ("thread_bytes", ctypes.c_int64)]


LORA_MAX_ROWS, LORA_MATMULS = 64, 4  # csrc/cpu_lora.h's RG_LORA_MAX_ROWS, RG_LORA_MATMULS


class LoRAStepBF16(ctypes.Structure):
    """csrc/cpu_lora.h's rg_lora_step_bf16: one fused step's adapter rows, grouped by slot."""

    _fields_ = [("n_groups", ctypes.c_int64), *((name, ctypes.c_int64 * LORA_MAX_ROWS) for name in
                                                 ("slot", "start", "len", "rows")),
                ("h", ctypes.c_void_p), ("h_stride", ctypes.c_int64)]


class LoRALayerBF16(ctypes.Structure):
    """csrc/cpu_lora.h's rg_lora_layer_bf16: one layer's adapter weights (addresses) and the step's rows."""

    _fields_ = [("step", ctypes.POINTER(LoRAStepBF16)), ("scales", ctypes.c_void_p), ("ranks", ctypes.c_void_p),
                ("max_rank", ctypes.c_int64), ("a", ctypes.c_void_p * LORA_MATMULS),
                ("b", ctypes.c_void_p * LORA_MATMULS)]


ALL_REDUCE_FN = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64)  # rg_parallel.all_reduce


class ParallelBF16(ctypes.Structure):
    """The fused decode step on one rank of a parallel group (csrc/cpu_parallel.h's rg_parallel)."""

    _fields_ = [("all_reduce", ALL_REDUCE_FN), ("ctx", ctypes.c_void_p), ("input", ctypes.c_int64),
                ("output", ctypes.c_int64), ("partials", ctypes.c_void_p)]


_STRUCTS = {"rg_layer_bf16": LayerBF16, "rg_weight": WeightDesc}
_SCALARS = {"int64_t": ctypes.c_int64, "float": ctypes.c_float, "int": ctypes.c_int, "rg_status": ctypes.c_int}


def ctype_of(c_type: str):
    """The ctypes type passing a value of C type `c_type`; None for void."""
    if c_type == "void":
        return None
    if c_type.endswith("*"):
        struct = next((t for name, t in _STRUCTS.items() if name in c_type.split()), None)
        return ctypes.c_void_p if struct is None else ctypes.POINTER(struct)
    return _SCALARS[c_type]


def bind(cdll: ctypes.CDLL, name: str):
    """The C function `name` of `cdll`, its ctypes types set from DECLARATIONS, as a Python function that takes
    exactly the declared arguments, by keyword only (and raises CKernelError on a failure status). The
    function is generated so that Python itself checks the names: these are hot-path calls. Its `argnames` are
    the declared names, `c_function` the ctypes function."""
    restype, args = DECLARATIONS[name]
    fn = getattr(cdll, name)
    fn.argtypes = [ctype_of(t) for _, t in args]
    fn.restype = ctype_of(restype)
    params = ", ".join(a for a, _ in args)
    if restype == "rg_status":
        body = (f"    status = fn({params})\n"
                f"    if status:\n"
                f"        raise CKernelError('{name} failed: ' + STATUS.get(status, f'status {{status}}'))\n"
                f"    return status\n")
    else:
        body = f"    return fn({params})\n"
    scope = {"fn": fn, "CKernelError": CKernelError, "STATUS": STATUS}
    exec(f"def {name}({'*, ' + params if params else ''}):\n{body}", scope)  # noqa: S102
    call = scope[name]
    call.argnames, call.c_function = tuple(a for a, _ in args), fn
    return call


class CKernels:
    """A loaded build of the kernels: `fn(name, dtype_suffix)` / `fn(full_name)` is a bound entry point."""

    def __init__(self, path: Path, isa: str = "native") -> None:
        self.path, self.isa = path, isa
        self.cdll = ctypes.CDLL(str(path))
        self._fns = {name: bind(self.cdll, name) for name in DECLARATIONS}
        self.d_max = int(self._fns["rg_d_max"]())
        self.has_decode_step = bool(self._fns["rg_has_decode_step"]())
        self.has_fast_bf16_linear = bool(self._fns["rg_has_fast_bf16_linear"]())
        # the AMX prefill GEMM (rg_linear_amx_bf16) runs here; RADIXGEN_DISABLE_AMX=1 says it does not (the runtime
        # then takes the routes of a CPU without it: the C kernels, oneDNN over a copy of a bf16 weight)
        self.has_amx = bool(self._fns["rg_has_amx"]()) and os.environ.get("RADIXGEN_DISABLE_AMX", "") in ("", "0")

    def fn(self, name: str, suffix: str | None = None):
        return self._fns[f"rg_{name}_{suffix}" if suffix else name]
