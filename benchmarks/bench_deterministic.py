"""What the deterministic mode costs: decode steps at batch 1 / 8 / 64 over 256-token contexts and a 1024-token
prefill, on the bundled default model in bf16, with the mode on and off (the default kernels) in one run. The two
runners take turns inside each round, so both meet the same machine (this one's memory bandwidth swings within
minutes); each figure is the best of its rounds.

    python benchmarks/bench_deterministic.py [--batches 1,8,64] [--prefill 1024] [--ctx 256] [--reps 8]

Targets (issue 33): decode at batch 64 at least 0.85x the default mode, at batch 1 at least 0.95x.
"""

from __future__ import annotations

import argparse
import os
import time

os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")  # as the scheduler process and bench_forward do

import torch
from bench_forward import OurModel

from radixgen.runtime.loader import resolve_model_path


def turns(fns: dict, reps: int) -> dict:
    """name -> best seconds of one run, the runs of the engines taking turns `reps` rounds (after a warm-up)."""
    for fn in fns.values():
        fn()
    best = {name: float("inf") for name in fns}
    for _ in range(reps):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            best[name] = min(best[name], time.perf_counter() - t0)
    return best


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batches", default="1,8,64")
    ap.add_argument("--prefill", type=int, default=1024)
    ap.add_argument("--ctx", type=int, default=256)
    ap.add_argument("--reps", type=int, default=8)
    args = ap.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    path = resolve_model_path(None)
    print(f"model: {path.name}, bf16, torch threads: {torch.get_num_threads()}")
    models = {mode: OurModel(path, "bfloat16", max(batches), args.ctx, deterministic=mode == "on")
              for mode in ("off", "on")}
    rows = []
    ids = torch.randint(0, 1000, (args.prefill,)).tolist()
    best = turns({mode: (lambda m=m: m.prefill(ids)) for mode, m in models.items()}, max(2, args.reps // 2))
    rows.append((f"prefill {args.prefill}", args.prefill / best["off"], args.prefill / best["on"]))
    for b in batches:
        fis = {mode: m.setup_decode(b, args.ctx) for mode, m in models.items()}
        best = turns({mode: (lambda m=m, fi=fis[mode]: m.runner.forward(fi)) for mode, m in models.items()},
                     args.reps * 2)
        rows.append((f"decode b={b}", b / best["off"], b / best["on"]))
    print(f"\n{'case':14} {'default tok/s':>14} {'deterministic':>14} {'ratio':>7}")
    for case, off, on in rows:
        print(f"{case:14} {off:14.1f} {on:14.1f} {on / off:6.2f}x")
    print("\ndeterministic: every attention query over fixed pieces of its context, prefill queries as decode\n"
          "queries (runtime/deterministic.py); default: the split follows the batch, prefill runs the extend kernel.")


if __name__ == "__main__":
    main()
