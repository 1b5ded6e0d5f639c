"""Tensor and pipeline parallelism on this machine: tp 1 (the baseline) beside tp 2 and pp 2, the CPU's threads
split between the ranks (tp 1: one process with every thread; tp 2 / pp 2: two ranks with half each).

The baselines are tp 1 with every thread and tp 1 on one rank's share of them ("tp 1 x1").

1. Serving throughput: an Engine per layout on the default model (bf16), all alive at once and taking turns
   (A, B, C, A, B, C ...): decode tokens/s with `--batches` concurrent greedy requests of `--tokens` new tokens
   each, and the time of a decode step (the run's wall time over its decode passes; with pp 2 each pass is one
   micro-batch, two of them in flight).
2. The anatomy of a step: rank 0 of a group of ModelRunners (spawned processes, gloo) runs decode steps itself,
   one at a time, with the time spent inside torch.distributed calls measured (all-reduce, gather, broadcast,
   point-to-point sends and the waits on them): the step's time and its communication share. For pp 2 the
   "communication" includes waiting for the other stage, since a lone step cannot overlap.
3. The fused decode step's all-reduce hook, its own cost: one process's fused step with a hook that reduces
   nothing (the two callbacks into Python per layer that tp 2 makes, without the communication) beside the
   plain step, taking turns. This is what the hook adds over C code calling a communication library directly;
   per-layer C calls instead would add a Python round trip and an OpenMP team start per layer.

    python benchmarks/bench_parallel.py [--quick] [--batches 1,8] [--tokens 64] [--rounds 3]
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import statistics
import time
from pathlib import Path

os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")

import torch

CPUS = os.cpu_count() or 1
# name -> (Engine / RuntimeConfig options, threads per rank): the CPUs split between the ranks; "tp 1 x1" is one
# process on one rank's share of them (what each rank of tp 2 / pp 2 has)
LAYOUTS = {"tp 1": ({}, CPUS), "tp 1 x1": ({}, max(1, CPUS // 2)), "tp 2": ({"tp_size": 2}, max(1, CPUS // 2)),
           "pp 2": ({"pp_size": 2}, max(1, CPUS // 2))}


# ---------------------------------------------------------------- 1. serving throughput


def serving(batches: list[int], tokens: int, rounds: int) -> None:
    from radixgen.runtime.engine import Engine

    engines = {name: Engine(dtype="bfloat16", num_threads=threads, max_total_tokens=16384, **kw)
               for name, (kw, threads) in LAYOUTS.items()}
    try:
        prompts = [f"Request {i}: write a long essay about the history of the number {i}." for i in range(max(batches))]
        params = {"max_new_tokens": tokens, "temperature": 0, "ignore_eos": True}
        for e in engines.values():  # warm-up
            e.generate(prompts[:2], {**params, "max_new_tokens": 4})
        print(f"\n1. serving throughput, {tokens} new tokens per request (best / median of {rounds} turns)")
        print(f"{'batch':>5} {'layout':>8} {'tok/s':>14} {'step ms':>16} {'vs tp 1':>8}")
        for b in batches:
            runs: dict[str, list[tuple[float, float]]] = {name: [] for name in engines}
            for _ in range(rounds):
                for name, e in engines.items():
                    before = e.get_server_info()["stats"]["decode_passes"]
                    t = time.perf_counter()
                    e.generate(prompts[:b], params)
                    wall = time.perf_counter() - t
                    passes = e.get_server_info()["stats"]["decode_passes"] - before
                    runs[name].append((b * tokens / wall, 1e3 * wall / max(passes, 1)))
            base = max(r[0] for r in runs["tp 1"])
            for name, r in runs.items():
                tps, step = [x[0] for x in r], [x[1] for x in r]
                print(f"{b:>5} {name:>8} {max(tps):>7.1f} /{statistics.median(tps):>6.1f} "
                      f"{min(step):>8.2f} /{statistics.median(step):>6.2f} {max(tps) / base:>7.2f}x")
    finally:
        for e in engines.values():
            e.shutdown()


# ---------------------------------------------------------------- 2. the anatomy of a step


COMM = ("all_reduce", "gather", "broadcast", "recv")


def _timed_comm(totals: dict) -> None:
    """Wrap torch.distributed's calls (and the waits on isend / irecv) to add their time to totals["comm"]."""
    import torch.distributed as dist

    def timed(fn):
        def call(*a, **kw):
            t = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                totals["comm"] += time.perf_counter() - t
        return call

    for name in COMM:
        setattr(dist, name, timed(getattr(dist, name)))
    from radixgen.runtime import distributed

    distributed.wait = timed(distributed.wait)


def _rank(layout: dict, threads: int, model_path: str, rank: int, addr, conn) -> None:
    from radixgen.runtime import distributed
    from radixgen.runtime.config import ModelConfig, RuntimeConfig
    from radixgen.runtime.executor.model_runner import ModelRunner
    from radixgen.runtime.loader import read_hf_config

    torch.set_num_threads(threads)
    cfg = RuntimeConfig(model=model_path, dtype="bfloat16", max_total_tokens=8192, max_running_requests=64,
                        **layout)
    if cfg.world_size > 1:
        distributed.init(cfg, ModelConfig.from_hf(read_hf_config(Path(model_path))), rank, *addr)
    totals = {"comm": 0.0}
    _timed_comm(totals)
    runner = ModelRunner(cfg, model_path)
    if rank:
        runner.group.serve()
        return
    conn.send("ready")
    while (msg := conn.recv()) is not None:
        batch, steps, context = msg
        conn.send(_decode_steps(runner, totals, batch, steps, context))
    if runner.group is not None:
        runner.group.close()


def _decode_steps(runner, totals: dict, batch: int, steps: int, context: int) -> tuple[float, float]:
    """(best step seconds, its communication seconds) over `steps` decode steps at `context` tokens."""
    from radixgen.runtime.executor.step_messages import ForwardInput
    from radixgen.runtime.scheduler.kv_manager import KVCacheManager

    kv = KVCacheManager.for_runner(runner)
    rows = [kv.table.allocate() for _ in range(batch)]
    for r in rows:
        kv.table.write(r, 0, kv.allocate(context))
    best = (float("inf"), 0.0)
    ids = torch.full((batch,), 42)
    for i in range(steps):
        slots = kv.allocate(batch)
        kv.table.write_cells(torch.tensor(rows), torch.full((batch,), context + i), slots)
        fi = ForwardInput(ids, torch.full((batch,), context + i), slots, torch.tensor(rows), [context + i] * batch,
                          [1] * batch, torch.arange(batch))
        comm, t = totals["comm"], time.perf_counter()
        runner.forward(fi)
        elapsed = time.perf_counter() - t
        best = min(best, (elapsed, totals["comm"] - comm))
    kv.flush()
    for r in rows:
        kv.free(kv.table.read(r, 0, context + steps))
        kv.table.free(r)
    return best


def anatomy(batches: list[int], steps: int, rounds: int, context: int) -> None:
    from radixgen.runtime.config import ModelConfig, RuntimeConfig
    from radixgen.runtime.engine.ranks import GroupHost
    from radixgen.runtime.loader import read_hf_config, resolve_model_path

    path = str(resolve_model_path(None))
    ctx = mp.get_context("spawn")
    groups, hosts, procs = {}, [], []
    for name, (layout, threads) in LAYOUTS.items():
        cfg = RuntimeConfig(model=path, dtype="bfloat16", max_total_tokens=8192, max_running_requests=64, **layout)
        addr = None
        if cfg.world_size > 1:
            hosts.append(GroupHost(cfg, ModelConfig.from_hf(read_hf_config(Path(path)))))
            addr = hosts[-1].addr
        parent, child = ctx.Pipe()
        for r in range(cfg.world_size):
            procs.append(ctx.Process(target=_rank, args=(layout, threads, path, r, addr, child if r == 0 else None)))
            procs[-1].start()
        groups[name] = parent
    try:
        for conn in groups.values():
            assert conn.recv() == "ready"
        print(f"\n2. one decode step at {context}-token contexts, run alone (best / median of {rounds} turns of "
              f"{steps} steps; comm: time inside torch.distributed on rank 0)")
        print(f"{'batch':>5} {'layout':>8} {'step ms':>16} {'comm ms':>9} {'comm share':>11} {'vs tp 1':>8}")
        for b in batches:
            runs: dict[str, list[tuple[float, float]]] = {name: [] for name in groups}
            for _ in range(rounds):
                for name, conn in groups.items():
                    conn.send((b, steps, context))
                    runs[name].append(conn.recv())
            base = min(r[0] for r in runs["tp 1"])
            for name, r in runs.items():
                best = min(r)
                med = statistics.median(x[0] for x in r)
                print(f"{b:>5} {name:>8} {1e3 * best[0]:>8.2f} /{1e3 * med:>6.2f} {1e3 * best[1]:>9.2f} "
                      f"{best[1] / best[0]:>10.0%} {base / best[0]:>7.2f}x")
    finally:
        for conn in groups.values():
            conn.send(None)
        for p in procs:
            p.join(60)
            if p.is_alive():
                p.kill()


def hook_cost(batches: list[int], steps: int, rounds: int, context: int) -> None:
    from radixgen.kernels import cpu, cpu_fused
    from radixgen.runtime.config import RuntimeConfig
    from radixgen.runtime.executor.model_runner import ModelRunner

    if not (cpu.available() and cpu.lib().has_decode_step):
        print("\n3. the fused step's hook: skipped (no fused decode step in this CPU build)")
        return
    torch.set_num_threads(max(1, CPUS // 2))
    runner = ModelRunner(RuntimeConfig(dtype="bfloat16", max_total_tokens=8192, max_running_requests=64))
    fused, calls = runner.fused_decode, [0]
    hook = cpu_fused.TensorParallelHook(lambda t: calls.__setitem__(0, calls[0] + 1))
    layers = runner.model_config.num_layers
    print(f"\n3. the fused step's all-reduce hook on one process ({max(1, CPUS // 2)} threads; {2 * layers} callbacks "
          f"a step, reducing nothing; best / median of {rounds} turns of {steps} steps)")
    print(f"{'batch':>5} {'plain ms':>16} {'with hook ms':>16} {'per callback us':>16}")
    for b in batches:
        times: dict[str, list[float]] = {"plain": [], "hook": []}
        for _ in range(rounds):
            for name in times:
                fused.hook = hook if name == "hook" else None
                before = calls[0]
                best, _ = _decode_steps(runner, {"comm": 0.0}, b, steps, context)
                times[name].append(best)
                assert name == "plain" or calls[0] - before == 2 * layers * steps
        plain, with_hook = min(times["plain"]), min(times["hook"])
        print(f"{b:>5} {1e3 * plain:>8.2f} /{1e3 * statistics.median(times['plain']):>6.2f} "
              f"{1e3 * with_hook:>8.2f} /{1e3 * statistics.median(times['hook']):>6.2f} "
              f"{1e6 * (with_hook - plain) / (2 * layers):>16.1f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="about a minute: fewer turns and tokens")
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--tokens", type=int, default=64, help="new tokens per request (serving)")
    ap.add_argument("--rounds", type=int, default=3, help="turns of each layout")
    ap.add_argument("--context", type=int, default=256, help="context length of the step anatomy")
    args = ap.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    tokens, rounds, steps = (16, 2, 6) if args.quick else (args.tokens, args.rounds, 24)
    print(f"{CPUS} CPUs; threads per rank: " + ", ".join(f"{n} {t}" for n, (_, t) in LAYOUTS.items())
          + "; the default model, bfloat16")
    serving(batches, tokens, rounds)
    anatomy(batches, steps, rounds, args.context)
    hook_cost(batches, steps, rounds, args.context)


if __name__ == "__main__":
    main()
