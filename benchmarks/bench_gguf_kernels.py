"""The GGUF block matmuls (radixgen.kernels.cpu_gguf) against the machine: Q4_K / Q5_K / Q6_K / Q4_0 / Q4_1 / Q8_0 GEMV
(1 to 8 input rows) at a 2048 x 8192 weight in both orientations, as GB/s of the weight bytes it streams, next to
a float32 torch matmul of the dequantized weight and the machine's read bandwidth (a large tensor's sum), measured
in the same run with the same threads (each the best of its repetitions). Each call reads a weight from memory, not
cache: the calls cycle over copies far larger than the last-level cache together. Well under a minute:

    python benchmarks/bench_gguf_kernels.py [--threads N]

With --model, the bundled default model as `make demo` loads it (quantization auto: its own Q4_1 / Q8_0 blocks)
instead: b1 decode (a 256-token context) and prefill-512 tok/s, beside llama.cpp on the same file where a Python
with llama-cpp-python is given (--llama PYTHON, run as a subprocess; never imported here), the two taking turns:

    RADIXGEN_CPU_ISA=x86-64-v3 python benchmarks/bench_gguf_kernels.py --model --llama /path/to/venv/bin/python
"""

from __future__ import annotations

import argparse
import itertools
import json
import subprocess
import time

import numpy as np
import torch

from radixgen.kernels import cpu, cpu_gguf

CACHE_BYTES = 256 << 20  # what the copies of a weight add up to at least: past any L3


def best_seconds(fn, reps: int) -> float:
    """The fastest of `reps` calls: on a shared machine the others are the time it spent descheduled."""
    fn()
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times)


def read_bandwidth() -> float:
    big = torch.ones(256 << 20, dtype=torch.float32)  # 1 GiB
    return big.numel() * 4 / best_seconds(lambda: big.sum(), 5) / 1e9


def random_blocks(type_name: str, n: int, k: int, seed: int) -> torch.Tensor:
    gen = np.random.default_rng(seed)
    raw = gen.integers(0, 256, (n, k // cpu_gguf.BLOCK_VALUES[type_name], cpu_gguf.FILE_BYTES[type_name]),
                       dtype=np.uint8)
    at = 208 if type_name == "Q6_K" else 0  # d (and dmin / min) of each block
    scales = [1e-3, 7.5e-3] if type_name in ("Q4_K", "Q5_K", "Q4_1") else [1e-3]
    raw[..., at:at + 2 * len(scales)] = np.array(scales, np.float16).view(np.uint8)
    return torch.from_numpy(raw.reshape(n, -1))


def bench(kl, type_name: str, n: int, k: int) -> None:
    w0 = cpu_gguf.repack(random_blocks(type_name, n, k, 0), type_name, k)
    copies = [w0] + [cpu_gguf.KQuantWeight(type_name, n, k, w0.data.clone())
                     for _ in range(max(1, CACHE_BYTES // w0.nbytes))]
    dense = cpu_gguf.unpack(w0)
    dense_copies = [dense] + [dense.clone() for _ in range(max(1, CACHE_BYTES // (dense.numel() * 4)))]
    for m in (1, 4, 8):
        x = torch.randn(m, k)
        ws, ds = itertools.cycle(copies), itertools.cycle(dense_copies)
        t = best_seconds(lambda x=x, ws=ws: cpu_gguf._linear(kl, next(ws), x), 30)
        tf = best_seconds(lambda x=x, ds=ds: x @ next(ds).T, 10)
        print(f"{type_name} {n:>5} x {k:<5} M={m}  ours {t * 1e3:7.3f} ms {w0.nbytes / t / 1e9:6.1f} GB/s"
              f"  | torch f32 dequantized {tf * 1e3:7.3f} ms {dense.numel() * 4 / tf / 1e9:6.1f} GB/s"
              f"  | ours {tf / t:5.1f}x faster")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--model", action="store_true", help="the default model's decode and prefill instead")
    ap.add_argument("--llama", help="a Python with llama-cpp-python, for llama.cpp's figures beside ours")
    ap.add_argument("--rounds", type=int, default=2, help="--model: turns each engine takes (best kept)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if args.model:
        return bench_model(args)
    kl = cpu.lib()
    if kl is None:
        raise SystemExit(f"CPU kernels unavailable: {cpu.unavailable_reason()}")
    print(f"build {kl.isa}, {args.threads} threads; machine read bandwidth {read_bandwidth():.1f} GB/s "
          f"(torch sum of 1 GiB)")
    for n, k in ((2048, 8192), (8192, 2048)):
        bench(kl, "Q4_K", n, k)
    for t in ("Q5_K", "Q6_K", "Q4_0", "Q4_1", "Q8_0"):
        bench(kl, t, 2048, 8192)


LLAMA = """
import json, sys, time
from llama_cpp import Llama
path, threads, ctx, reps = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
llm = Llama(model_path=path, n_ctx=2048, n_batch=512, n_ubatch=512, n_threads=threads, n_threads_batch=threads,
            verbose=False)
def best(fn, reps):
    fn(); out = []
    for _ in range(reps):
        t = time.perf_counter(); fn(); out.append(time.perf_counter() - t)
    return min(out)
prompt = [100 + i for i in range(512)]
def prefill():
    llm.reset(); llm.eval(prompt)
pre = best(prefill, 3)
llm.reset(); llm.eval(prompt[:ctx])
def step():
    llm.eval([7]); llm.n_tokens -= 1  # the same position every time: a context of ctx tokens
dec = best(step, reps)
print(json.dumps({"prefill": 512 / pre, "decode": 1 / dec}))
"""


def bench_model(args) -> None:
    from bench_forward import OurModel, best_of

    from radixgen.runtime.config import RuntimeConfig
    from radixgen.runtime.loader import default_gguf_path, model_path_for

    gguf_file, ctx = default_gguf_path(), 256
    ours = OurModel(model_path_for(RuntimeConfig()), "auto", 1, 1024, num_threads=args.threads)
    r = ours.runner
    print(f"build {cpu.lib().isa}, {args.threads} threads; {gguf_file.name}: {r.dtype}, "
          f"{sorted(set(r.ops.linear_methods(r.model)))}, fused decode step {r.fused_decode is not None}")
    best = {"ours": [0.0, 0.0], "llama.cpp": [0.0, 0.0]}
    for _ in range(args.rounds):
        pre = best_of(lambda: ours.prefill([100 + i for i in range(512)]), 3)
        fi = ours.setup_decode(1, ctx)
        dec = best_of(lambda fi=fi: r.forward(fi), 30)
        best["ours"] = [max(best["ours"][0], 1 / dec), max(best["ours"][1], 512 / pre)]
        if args.llama:
            out = subprocess.run([args.llama, "-c", LLAMA, str(gguf_file), str(args.threads), str(ctx), "30"],
                                 capture_output=True, text=True, check=True).stdout
            got = json.loads(out.strip().splitlines()[-1])
            best["llama.cpp"] = [max(best["llama.cpp"][0], got["decode"]), max(best["llama.cpp"][1], got["prefill"])]
    for name, (dec, pre) in best.items():
        if name == "ours" or args.llama:
            print(f"{name:>10}: b1 decode {dec:7.1f} tok/s  prefill-512 {pre:7.1f} tok/s")
    if args.llama:
        (od, op), (ld, lp) = best["ours"], best["llama.cpp"]
        print(f"     ratio: b1 decode {od / ld:.2f}x  prefill-512 {op / lp:.2f}x")


if __name__ == "__main__":
    main()
