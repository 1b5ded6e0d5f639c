"""The CPU prefill linear layers by row count, in ms a call: the C AVX512-BF16 kernels (streaming up to 16 rows, the
blocked GEMM past it), the AMX tile GEMM over the same layout (csrc/cpu_linear_amx.h), and oneDNN over the bf16
weight copied out of the K-pair layout for the call (cpu_linear.dense_bf16, the route before the AMX GEMM), with the
copy alone and oneDNN on a ready row-major weight beside them; int8 and int4 weights on the C GEMM and on AMX. The
shapes are the layers of SmolLM2-135M and of Qwen2-0.5B. The kernels take turns in each repetition; each figure is
the best of the repetitions.

    python benchmarks/bench_linear.py [--rows 1,4,8,16,32,64,128,256,512,1024] [--models smollm2,qwen2] [--quant]
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

from radixgen.kernels import cpu, cpu_linear
from radixgen.runtime.layers.quantization.base import QuantizedWeight

SHAPES = {  # (name, N, K): qkv, o, gate_up, down
    "smollm2": [("qkv", 960, 576), ("o", 576, 576), ("gate_up", 3072, 576), ("down", 576, 1536)],
    "qwen2": [("qkv", 1152, 896), ("o", 896, 896), ("gate_up", 9728, 896), ("down", 896, 4864)],
}


def best_ms(fns: dict, reps: int) -> dict:
    """Each function's best time in ms over `reps` rounds, the functions taking turns within a round."""
    for fn in fns.values():
        fn()
    best = dict.fromkeys(fns, float("inf"))
    for _ in range(reps):
        for name, fn in fns.items():
            t = time.perf_counter()
            fn()
            best[name] = min(best[name], (time.perf_counter() - t) * 1e3)
    return best


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default="1,4,8,16,32,64,128,256,512,1024")
    ap.add_argument("--models", default="smollm2,qwen2")
    ap.add_argument("--quant", action="store_true", help="also int8 and int4 weights (C GEMM against AMX)")
    ap.add_argument("--reps", type=int, default=20)
    args = ap.parse_args()
    kl = cpu.lib()
    if kl is None or not kl.has_decode_step:  # nothing to compare on this CPU: not a failure of `make bench`
        print("skipped: the K-pair layout's kernels need the C kernels' AVX512-BF16 build")
        return
    print(f"torch threads: {torch.get_num_threads()}, AMX GEMM: {kl.has_amx}")
    rows = [int(r) for r in args.rows.split(",")]
    head = f"{'layer':22} {'M':>5} {'C':>8} {'AMX':>8} {'copy+oneDNN':>12} {'copy':>7} {'oneDNN':>7} {'C/AMX':>6}"
    if args.quant:
        head += f" {'int8 C':>7} {'AMX':>7} {'int4 C':>7} {'AMX':>7}"
    print(head)
    gen = torch.Generator().manual_seed(0)
    warm = torch.randn(256, 1024).bfloat16()
    for _ in range(20):  # the thread pool awake and the clocks up before the first figure
        F.linear(warm, warm)
    for model in args.models.split(","):
        for name, n, k in SHAPES[model]:
            w = torch.randn(n, k, generator=gen) * 0.05
            pw, dense = cpu_linear.pack_bf16(w), w.bfloat16()
            quant = {"int8": QuantizedWeight.int8_from(w).pack(), "int4": QuantizedWeight.int4_from(w).pack()}
            for m in rows:
                x = torch.randn(m, k, generator=gen).bfloat16()
                fns = {"c": lambda x=x, pw=pw: cpu_linear._linear(kl, pw, x, None),
                       "copy+onednn": lambda x=x, pw=pw: F.linear(x, cpu_linear.dense_bf16(pw)),
                       "copy": lambda pw=pw: cpu_linear.dense_bf16(pw),
                       "onednn": lambda x=x, dense=dense: F.linear(x, dense)}
                if kl.has_amx:
                    fns["amx"] = lambda x=x, pw=pw: cpu_linear._linear(kl, pw, x, None, amx=True)
                if args.quant:
                    for q, qw in quant.items():
                        fns[f"{q} c"] = lambda x=x, qw=qw: cpu_linear._linear(kl, qw, x, None)
                        if kl.has_amx:
                            fns[f"{q} amx"] = lambda x=x, qw=qw: cpu_linear._linear(kl, qw, x, None, amx=True)
                t = best_ms(fns, args.reps if m < 512 else max(3, args.reps // 4))
                amx = t.get("amx", float("nan"))
                layer = f"{model} {name} {n}x{k}"
                line = (f"{layer:22} {m:5} {t['c']:8.3f} {amx:8.3f} {t['copy+onednn']:12.3f} "
                        f"{t['copy']:7.3f} {t['onednn']:7.3f} {t['c'] / amx:6.2f}")
                if args.quant:
                    line += "".join(f" {t[f'{q} c']:7.3f} {t.get(f'{q} amx', float('nan')):7.3f}" for q in quant)
                print(line, flush=True)
    print("\nms a call, best of the repetitions; C: rg_linear_bf16 (gemv to 16 rows, blocked GEMM past it); AMX: "
          "rg_linear_amx_bf16;\ncopy+oneDNN: F.linear over cpu_linear.dense_bf16 (the weight copied out of the K-pair "
          "layout); copy: that copy alone;\noneDNN: F.linear on a ready row-major bf16 weight (no copy).")


if __name__ == "__main__":
    main()
