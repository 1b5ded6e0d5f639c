"""The hierarchical cache's tier copies (ground.kv_pool.copy_kv_rows) on the CPU: milliseconds per copy of N
token rows between a model-dtype pool and a host tier, the C kernels (kernels.cpu_kv_copy, on 1 and on 2 threads)
against the torch path (a few ops per layer's buffer), taking turns. Shapes default to SmolLM2-135M-Instruct's (30
layers, 3 KV heads, head_dim 64, bf16 pool, int8 host tier); rows are random distinct slots, as eviction leaves them.

    python benchmarks/bench_kv_copy.py [--rows 16,256,700,2048] [--layers 30] [--kv-heads 3] [--head-dim 64]
                                       [--dtype bfloat16] [--host int8|fp8_e4m3|same] [--repeat 20]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

from radixgen.kernels import cpu, cpu_kv_copy
from radixgen.runtime.ground import kv_pool
from radixgen.runtime.ground.kv_pool import HostKVPool, KVPool, one_thread

HOST = {"int8": torch.int8, "fp8_e4m3": torch.float8_e4m3fn, "same": None}


def time_ms(fn, repeat: int) -> float:
    fn()
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default="16,256,700,2048")
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--kv-heads", type=int, default=3)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16")
    ap.add_argument("--host", choices=tuple(HOST), default="int8")
    ap.add_argument("--repeat", type=int, default=20)
    args = ap.parse_args()
    rows = [int(r) for r in args.rows.split(",")]
    dtype = getattr(torch, args.dtype)
    slots = 2 * max(rows) + 1
    pool = KVPool(args.layers, slots, args.kv_heads, args.head_dim, dtype)
    host = HostKVPool(args.layers, slots, args.kv_heads, args.head_dim, dtype, HOST[args.host])
    for b in pool.k_buffers + pool.v_buffers:
        b.copy_(torch.randn(b.shape))
    kl = cpu.lib()
    if kl is None:
        raise SystemExit(f"the CPU kernels are unavailable: {cpu.unavailable_reason()}")
    print(f"copies of N token rows, {args.layers} layers x K/V, {args.kv_heads} KV heads, head_dim {args.head_dim}, "
          f"{args.dtype} pool <-> {args.host} host tier; ms per copy (median of {args.repeat}); load average "
          f"{os.getloadavg()[0]:.2f}")
    print(f"{'N':>6} {'direction':>14} {'torch':>8} {'C 1 thr':>8} {'C 2 thr':>8} {'speed-up':>8}")
    for n in rows:
        si, di = torch.randperm(slots - 1)[:n] + 1, torch.randperm(slots - 1)[:n] + 1
        for name, a, b in (("pool -> host", pool, host), ("host -> pool", host, pool)):
            def torch_path(a=a, b=b, si=si, di=di):
                with one_thread():
                    kv_pool._copy_kv_rows(a, si, b, di)

            def c_path(threads, a=a, b=b, si=si, di=di):
                cpu_kv_copy._copy_rows(kl, a.c_buffers(), si, b.c_buffers(), di, threads)

            t_torch = time_ms(torch_path, max(3, args.repeat // 4))
            t1, t2 = time_ms(lambda: c_path(1), args.repeat), time_ms(lambda: c_path(2), args.repeat)
            print(f"{n:>6} {name:>14} {t_torch:>8.3f} {t1:>8.3f} {t2:>8.3f} {t_torch / min(t1, t2):>7.1f}x")
    print(f"load average after: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
