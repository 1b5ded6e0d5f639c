"""Compile every kernel for an sm_90 (H100/H200) target without a GPU, through the real Triton compiler.

The interpreter accepts programs the compiler rejects (and ignores shared-memory limits), so this catches
what only a GPU run would otherwise show. Run as a script with TRITON_INTERPRET unset; it launches nothing:
each kernel's launch is intercepted, its argument types are read off, and it is compiled to a cubin.
Prints one line per compiled variant and exits non-zero on the first failure.
"""

from __future__ import annotations

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from triton.runtime.jit import JITFunction

import radixgen.kernels as K
from radixgen.kernels import (
    _attention_triton,
    _batch_invariant_triton,
    _fused_moe_triton,
    _norm_triton,
    _quant_matmul_triton,
    _rotary_triton,
    _store_kv_triton,
    _triton_env,
)

TARGET = GPUTarget("cuda", 90, 32)
SMEM_LIMIT = 227 * 1024  # the per-block maximum on sm_90
TYPES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16", torch.int64: "i64", torch.int8: "i8",
         torch.int32: "i32"}
seen: set[str] = set()


class CompileInsteadOfLaunch:
    def __init__(self, fn: JITFunction):
        self.fn = fn

    def __getitem__(self, grid):
        return self.compile

    def compile(self, *args, **kwargs):
        options = {k: kwargs.pop(k) for k in ("num_warps", "num_stages") if k in kwargs}
        values = dict(zip(self.fn.arg_names, args, strict=False)) | kwargs
        signature, constexprs = {}, {}
        for param in self.fn.params:
            value = values[param.name]
            if param.is_constexpr:
                signature[param.name], constexprs[param.name] = "constexpr", value
            elif isinstance(value, torch.Tensor):
                signature[param.name] = "*" + TYPES[value.dtype]
            elif isinstance(value, int):
                signature[param.name] = "i32" if -2**31 <= value < 2**31 else "i64"
            else:
                signature[param.name] = "fp32"
        key = f"{self.fn.__name__} {sorted(signature.items())} {sorted(constexprs.items())} {options}"
        if key in seen:
            return
        seen.add(key)
        compiled = triton.compile(ASTSource(self.fn, signature, constexprs), target=TARGET, options=options)
        shared = compiled.metadata.shared
        dtypes = sorted({v for v in signature.values() if v.startswith("*f") or v.startswith("*b")})
        print(f"{self.fn.__name__:28s} {','.join(dtypes):12s} smem {shared:7d}  {constexprs}")
        assert shared <= SMEM_LIMIT, f"{self.fn.__name__} needs {shared} bytes of shared memory"


def intercept_launches() -> None:
    assert not _triton_env.INTERPRET, "run with TRITON_INTERPRET unset"
    for module in (_attention_triton, _fused_moe_triton, _norm_triton, _rotary_triton, _store_kv_triton,
                   _batch_invariant_triton, _quant_matmul_triton):
        module.check_launchable = lambda *args: None  # CPU tensors only carry dtypes and strides here
        for name, obj in vars(module).copy().items():
            if isinstance(obj, JITFunction) and name.endswith("_kernel"):
                setattr(module, name, CompileInsteadOfLaunch(obj))


def main() -> None:
    intercept_launches()
    for dtype in (torch.bfloat16, torch.float32):
        for head_dim, num_q_heads, num_kv_heads in ((128, 32, 8), (80, 6, 2)):  # Llama-3-8B; a non-power-of-2
            pool = torch.zeros(16, num_kv_heads, head_dim, dtype=dtype)
            table, rows = torch.zeros(2, 64, dtype=torch.int64), torch.zeros(2, dtype=torch.int64)
            q = torch.zeros(2, num_q_heads, head_dim, dtype=dtype)
            K.decode_attention(q, pool, pool, table, rows, rows + 1, 0.1, num_kv_splits=4)
            K.extend_attention(q, pool, pool, table, rows, rows, rows + 1, 0.1)
            K.store_kv(pool, pool, rows, q[:, :num_kv_heads], q[:, :num_kv_heads])
            K.rotary_embedding_(rows, q, q[:, :num_kv_heads], torch.zeros(8, head_dim), head_dim)
        for hidden in (4096 + 576,):  # wider than one block: the looping path
            x = torch.zeros(2, hidden, dtype=dtype)
            K.fused_add_rmsnorm(x, x[0], 1e-6, x)
            K.fused_add_rmsnorm(x, x[0], 1e-6)
    for dtype in (torch.bfloat16, torch.float16, torch.float32):  # a Qwen3-30B-A3B-shaped expert block
        e, h, i, t, k = 128, 2048, 768, 4, 8
        K.fused_moe(torch.zeros(t, h, dtype=dtype), torch.zeros(e, 2 * i, h, dtype=dtype),
                    torch.zeros(e, h, i, dtype=dtype), torch.zeros(t, k), torch.zeros(t, k, dtype=torch.int32))
    batch_invariant_kernels()
    print(f"compiled {len(seen)} kernel variants for sm_90")


def batch_invariant_kernels() -> None:
    """The deterministic mode's variants (radixgen.kernels.batch_invariant) at a Llama-3-8B / Qwen3 shape."""
    from radixgen.kernels import batch_invariant as bi
    from radixgen.kernels.cpu import FIXED_PIECE

    # (few variants: each costs the CI seconds of a compile; the other dtypes differ only in their loads)
    pool = torch.zeros(16, 8, 128, dtype=torch.bfloat16)
    table, rows = torch.zeros(2, 512, dtype=torch.int64), torch.zeros(2, dtype=torch.int64)
    q = torch.zeros(2, 32, 128, dtype=torch.bfloat16)
    bi.decode_attention_fixed(q, pool, pool, table, rows, rows + 1, 0.1, FIXED_PIECE, 4)
    bi.extend_attention_fixed(q, pool, pool, table, rows, rows, rows + 1, 0.1, FIXED_PIECE, 4)
    for dtype in (torch.bfloat16, torch.float32):  # tensor-core tiles, and the float32 ieee tiles' shared memory
        bi.fixed_matmul(torch.zeros(3, 4096, dtype=dtype), torch.zeros(14336, 4096, dtype=dtype))
    x = torch.zeros(3, 4096, dtype=torch.bfloat16)
    K.int8_matmul(x, torch.zeros(1024, 4096, dtype=torch.int8), torch.zeros(1024), batch_invariant=True)
    logits = torch.zeros(2, 151936)
    for op in (bi.row_log_softmax, bi.row_sum, bi.row_cumsum_, bi.row_argmax):
        op(logits)


if __name__ == "__main__":
    main()
