"""What the deterministic mode costs: decode steps at batch 1 and 8 over 256-token contexts and a 512-token prefill,
with the mode on and off (the default kernels) in one run, per build of the CPU kernels this CPU can run (native,
and the emulated older CPUs: x86-64-v3 is an AVX2 CPU, skylake-avx512 one with AVX-512 but no BF16), on the bundled
default model (bf16) and on a GGUF file shaped like SmolLM2-1.7B (scale_gguf.py's "1.7b": hidden 2048, MLP 8192, 32
heads, tied; --gguf-type Q4_0 by default, its tied embedding in Q6_K as llama.cpp writes them) whose blocks are
random, written once into --gguf-dir (the shared /tmp/scale cache). Each build runs in its own process
(RADIXGEN_CPU_ISA is read once). The two runners take turns inside each round, so both meet the same machine; each
figure is the best of its rounds.

    python benchmarks/bench_deterministic.py [--models default,gguf,f32] [--builds native,x86-64-v3,skylake-avx512]
        [--batches 1,8] [--prefill 512] [--ctx 256] [--reps 4] [--layers 24] [--gguf-type Q4_0] [--clock cpu]
        [--threads 1]

f32 is the default model with dtype float32 (the mode's float32 matmul against oneDNN's). --layers cuts the
GGUF's depth (every layer has the 1.7B shapes: the ratios hold, the run gets shorter).
Target (issue 49): decode at batch 1 at most 1.3x slower than the default mode (ratio >= 0.77).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")  # as the scheduler process and bench_forward do

import torch
from scale_gguf import FILE_TYPES, SHAPES, write_gguf

CLOCKS = {"wall": time.perf_counter, "cpu": time.process_time}  # cpu: this process's CPU seconds, all threads


def turns(fns: dict, reps: int, clock=time.perf_counter) -> dict:
    """name -> best seconds of one run, the runs of the engines taking turns `reps` rounds (after a warm-up)."""
    for fn in fns.values():
        fn()
    best = {name: float("inf") for name in fns}
    for _ in range(reps):
        for name, fn in fns.items():
            t0 = clock()
            fn()
            best[name] = min(best[name], clock() - t0)
    return best


def one_build(args) -> None:
    """This process's build (RADIXGEN_CPU_ISA): the rows of every model asked for."""
    from bench_forward import OurModel

    from radixgen.runtime.loader import resolve_model_path

    batches = [int(b) for b in args.batches.split(",")]
    build = os.environ.get("RADIXGEN_CPU_ISA") or "native"
    for name in args.models.split(","):
        dtype = "bfloat16"
        if name == "default":
            path, kw = resolve_model_path(None), {}
        elif name == "f32":  # the default model in float32: oneDNN against the mode's fixed float32 chains
            path, kw, dtype = resolve_model_path(None), {}, "float32"
        else:
            shape = SHAPES["1.7b"]._replace(layers=args.layers)  # every layer the 1.7B's shapes
            folder = Path(args.gguf_dir)
            folder.mkdir(parents=True, exist_ok=True)
            path, kw = folder / f"{shape.name}-{args.layers}l-{args.gguf_type}.gguf", dict(quantization="gguf")
            if not path.exists():  # (write_gguf goes through a temporary name)
                write_gguf(path, shape, args.gguf_type)
        models = {mode: OurModel(path, dtype, max(batches), args.ctx, deterministic=mode == "on", **kw)
                  for mode in ("off", "on")}
        label = f"{build:14} {name:8}"
        ids = torch.randint(0, 1000, (args.prefill,)).tolist()
        prefills = {mode: (lambda m=m, ids=ids: m.prefill(ids)) for mode, m in models.items()}
        best = turns(prefills, max(1, args.reps // 2), CLOCKS[args.clock])
        rows = [(f"prefill {args.prefill}", args.prefill / best["off"], args.prefill / best["on"])]
        for b in batches:
            fis = {mode: m.setup_decode(b, args.ctx) for mode, m in models.items()}
            best = turns({mode: (lambda m=m, fi=fis[mode]: m.runner.forward(fi)) for mode, m in models.items()},
                         args.reps * 2, CLOCKS[args.clock])
            rows.append((f"decode b={b}", b / best["off"], b / best["on"]))
        for case, off, on in rows:
            print(f"{label} {case:12} {off:14.1f} {on:14.1f} {on / off:6.2f}x", flush=True)
        del models


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default="default,gguf")
    ap.add_argument("--builds", default="native,x86-64-v3,skylake-avx512")
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--prefill", type=int, default=512)
    ap.add_argument("--ctx", type=int, default=256)
    ap.add_argument("--reps", type=int, default=4)
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--clock", default="wall", choices=tuple(CLOCKS),
                    help="cpu: CPU seconds instead of wall seconds (steadier on a shared machine; with --threads 1 "
                         "the figures are single-core work rates)")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    ap.add_argument("--gguf-type", default="Q4_0", choices=FILE_TYPES)
    ap.add_argument("--gguf-dir", default="/tmp/scale", help="the random-weight files' cache (scale_gguf.py)")
    ap.add_argument("--one-build", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.one_build:
        one_build(args)
        return
    from radixgen.kernels import _cpu_build

    print(f"CPU: {_cpu_build.cpu_model()}, torch threads: {torch.get_num_threads()}, clock: {args.clock}")
    print(f"{'build':14} {'model':8} {'case':12} {'default tok/s':>14} {'deterministic':>14} {'ratio':>7}", flush=True)
    for build in args.builds.split(","):
        missing = _cpu_build.missing_flags(build)
        if missing:
            print(f"{build:14} skipped: this CPU lacks {', '.join(missing)}")
            continue
        env = {**os.environ, "RADIXGEN_CPU_ISA": build}
        subprocess.run([sys.executable, __file__, "--one-build", *sys.argv[1:]], env=env, check=True)
    print("\ndeterministic: every attention query over fixed pieces of its context, prefill queries as decode\n"
          "queries, int8 / int4 matmuls in calls of at most 16 rows, GGUF Q4_0 / Q4_1 / Q8_0 ones of at most 8 (their\n"
          "panel GEMM starts at 9), float32 weights on the fixed float32 chains instead of oneDNN\n"
          "(runtime/deterministic.py); default: the split follows the batch, prefill runs the extend kernel and the "
          "GEMMs.")


if __name__ == "__main__":
    main()
