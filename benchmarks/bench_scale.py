"""Real-size CPU speed against llama.cpp: random-weight GGUF files of real shapes (SmolLM2-1.7B, a Llama-3-8B body;
the bundled model's tokenizer) in Q4_0, Q4_K_M, Q8_0 and MXFP4, written once to a cache folder, then radixgen
(Engine(model=file), as a user loads a .gguf) and llama.cpp (llama-cpp-python in its own venv) taking turns in
the same run on the same token ids: b1 and b8 decode, prefill-512 and -2048, decode after 4,096 tokens of context,
load time and resident memory, each figure beside its roofline from this machine's read bandwidth and matmul peak
measured in the run (decode: weight bytes per step + the KV it reads / bandwidth; prefill: FLOPs / matmul peak).
Each engine runs in its own process (scale_worker.py); the figures are medians over --reps turns.

    python benchmarks/bench_scale.py                       # 1.7B Q4_0,Q4_K_M,Q8_0, every case, llama.cpp native
    python benchmarks/bench_scale.py --sizes 1.7b --types Q4_0 --cases b1,prefill512 --reps 2   # a few minutes
    python benchmarks/bench_scale.py --model default --builds native,avx2    # the bundled 135M model, as `make demo`

--builds avx2 runs radixgen with RADIXGEN_CPU_ISA=x86-64-v3 and llama.cpp from the AVX2-only venv. A missing
llama.cpp venv is skipped with a message; benchmarks/README.md says how to build both venvs.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import gguf
import torch
from scale_gguf import FILE_TYPES, SHAPES, write_gguf

from radixgen.runtime.loader import default_gguf_path

HERE = Path(__file__).resolve().parent
CASES = {  # name -> (kind, batch, context or prompt length)
    "b1": ("decode", 1, 16), "b8": ("decode", 8, 16), "prefill512": ("prefill", 1, 512),
    "prefill2048": ("prefill", 1, 2048), "ctx4096": ("decode", 1, 4096),
}
LABELS = {"b1": "b1 decode tok/s", "b8": "b8 decode tok/s", "prefill512": "prefill-512 tok/s",
          "prefill2048": "prefill-2048 tok/s", "ctx4096": "decode after 4096 tok/s"}
ISA = {"native": None, "avx2": "x86-64-v3"}  # --builds: radixgen's RADIXGEN_CPU_ISA


# ---------------------------------------------------------------------------------------------- the machine


def best_of(fn, reps: int) -> float:
    fn()
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times)


def measure_ceilings() -> dict:
    """Read bandwidth (the sum of a 512 MiB tensor, far past the caches) and matmul peak (2048^3, the better of
    float32 and bf16 torch matmuls), both on every core, each the best of its repetitions."""
    x = torch.ones(128 * 2**20, dtype=torch.float32)
    bw = x.numel() * 4 / best_of(lambda: x.sum(), 5)
    x = None  # free it before the matmuls
    n, peak, peak_dtype = 2048, 0.0, ""
    for dt in (torch.float32, torch.bfloat16):
        a, b = torch.randn(n, n, dtype=dt), torch.randn(n, n, dtype=dt)
        f = 2 * n**3 / best_of(lambda a=a, b=b: a @ b, 3)
        if f > peak:
            peak, peak_dtype = f, str(dt).removeprefix("torch.")
    return {"bw": bw, "peak": peak, "peak_dtype": peak_dtype}


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return f"{line.split(':', 1)[1].strip()}, {os.cpu_count()} cores"
    except OSError:
        pass
    return f"unknown CPU, {os.cpu_count()} cores"


# ---------------------------------------------------------------------------------------------- costs


class Costs:
    """What one token costs a file, read from its tensor table: the weight bytes a decode step streams (every 2-D
    weight but the embedding, which is the head when there is no output.weight) and the FLOPs of a prefill."""

    def __init__(self, path: Path) -> None:
        r = gguf.GGUFReader(str(path))
        arch = r.fields["general.architecture"].contents()

        def meta(key):
            return r.fields[f"{arch}.{key}"].contents()

        self.layers, self.hidden, heads = meta("block_count"), meta("embedding_length"), meta("attention.head_count")
        kv_heads = meta("attention.head_count_kv")
        head_dim = self.hidden // heads
        tensors = {t.name: t for t in r.tensors}
        tied = "output.weight" not in tensors
        self.file_bytes = path.stat().st_size
        self.weight_bytes, self.layer_params, self.head_params = 0, 0, 0
        for name, t in tensors.items():
            if len(t.shape) < 2:
                continue
            params = int(t.n_elements)
            if name == "output.weight" or (tied and name == "token_embd.weight"):
                self.head_params = params
            elif name == "token_embd.weight":
                continue
            else:
                self.layer_params += params
            self.weight_bytes += int(t.n_bytes)
        self.kv_per_token = 2 * self.layers * kv_heads * head_dim * 2  # K and V, 16-bit in both engines
        self.attn_per_pair = 4 * self.layers * heads * head_dim  # QK^T and PV FLOPs per (query, key)

    def roofline(self, case: str, ceil: dict) -> float:
        """The case's ceiling in tokens per second."""
        kind, b, n = CASES[case]
        if kind == "decode":
            return b * ceil["bw"] / (self.weight_bytes + self.kv_per_token * b * n)
        flops = 2 * self.layer_params * n + 2 * self.head_params + self.attn_per_pair * n * n / 2
        return n * ceil["peak"] / flops


# ---------------------------------------------------------------------------------------------- the engines


class Worker:
    """scale_worker.py in its own process: loads the model, then answers one command per line."""

    def __init__(self, name: str, python: str, engine: str, model: str, opts: dict, env: dict | None = None):
        self.name = name
        self.log = tempfile.NamedTemporaryFile("w+", prefix=f"bench_scale_{name}_", suffix=".log", delete=False)
        self.proc = subprocess.Popen([python, str(HERE / "scale_worker.py"), engine, model, json.dumps(opts)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log, text=True,
                                     env={**os.environ, **(env or {})}, cwd=HERE)
        self.ready = self._reply()

    def _reply(self) -> dict:
        line = self.proc.stdout.readline()
        if not line:
            self.proc.wait()
            self.log.seek(0)
            tail = "".join(self.log.readlines()[-15:])
            raise RuntimeError(f"{self.name} exited with code {self.proc.returncode}:\n{tail}")
        return json.loads(line)

    def ask(self, **cmd) -> dict:
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()
        return self._reply()

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.proc.stdin.write('{"op": "quit"}\n')
                self.proc.stdin.flush()
                self.proc.wait(timeout=60)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait()
        Path(self.log.name).unlink(missing_ok=True)


def llama_python(template: str, build: str) -> str | None:
    """The llama.cpp venv's python for a build, or None (with a message) where it is missing or broken."""
    py = Path(template.format(build=build)) / "bin" / "python"
    if not py.exists():
        print(f"[skip] llama.cpp for build {build!r}: no venv at {py.parent.parent} (see benchmarks/README.md)")
        return None
    if subprocess.run([str(py), "-c", "import llama_cpp"], capture_output=True).returncode != 0:
        print(f"[skip] llama.cpp for build {build!r}: {py} cannot import llama_cpp")
        return None
    return str(py)


def warm_page_cache(path: Path) -> None:
    """Both engines load from a warm page cache: the file read once before either."""
    with open(path, "rb") as f:
        while f.read(64 << 20):
            pass


def run_file(label: str, path: Path, build: str, args, quantization: str) -> dict:
    costs = Costs(path)
    warm_page_cache(path)
    cases = args.cases.split(",")
    max_batch = max(CASES[c][1] for c in cases)
    ctx = max(CASES[c][2] for c in cases)
    opts = {"max_batch": max_batch, "ctx": ctx}
    isa = ISA[build]
    workers = {"radixgen": Worker("radixgen", sys.executable, "radixgen",
                                  "default" if quantization == "default" and args.model == "default" else str(path),
                                  {**opts, "quantization": quantization, "threads": args.threads},
                                  {"RADIXGEN_CPU_ISA": isa} if isa else None)}
    py = None if args.no_llama else llama_python(args.llama_venv, build)
    try:
        if py:
            workers["llama.cpp"] = Worker("llama.cpp", py, "llama", str(path),
                                          {**opts, "threads": args.threads or os.cpu_count()})
        ceils = [measure_ceilings()]
        times: dict[tuple[str, str], list[float]] = {}
        for ci, case in enumerate(cases):
            kind, b, n = CASES[case]
            for rep in range(args.reps):
                names = list(workers) if rep % 2 == 0 else list(reversed(workers))  # take turns, either going first
                seed = 1 + rep * 100 + ci  # a fresh prompt each turn (no cache hit), the same ids for both
                for name in names:
                    if kind == "prefill":
                        tps = n / workers[name].ask(op="prefill", n=n, seed=seed)["s"]
                    else:  # the same prompts every turn: each engine prefills them once, then keeps them
                        tps = b / workers[name].ask(op="decode", b=b, ctx=n, n=args.steps, seed=1 + ci)["s"]
                    times.setdefault((case, name), []).append(tps)
                    print(f"  [{label} {build} rep {rep + 1}] {name:9} {LABELS[case]:24} {tps:9.1f}", flush=True)
            ceils.append(measure_ceilings())
        mem = {name: w.ask(op="rss") for name, w in workers.items()}
    finally:
        for w in workers.values():
            w.close()
    ceil = {"bw": statistics.median(c["bw"] for c in ceils), "peak": statistics.median(c["peak"] for c in ceils),
            "peak_dtype": ceils[-1]["peak_dtype"]}
    return {"label": label, "build": build, "file_bytes": costs.file_bytes, "weight_bytes": costs.weight_bytes,
            "ceil": ceil, "ceils": ceils, "engines": list(workers),
            "load_s": {n: w.ready["load_s"] for n, w in workers.items()},
            "info": {n: {k: v for k, v in w.ready.items() if k not in ("load_s", "rss", "hwm")}
                     for n, w in workers.items()},
            "rss": {n: m["rss"] for n, m in mem.items()}, "hwm": {n: m["hwm"] for n, m in mem.items()},
            "rows": [(case, {n: statistics.median(times[(case, n)]) for n in workers},
                      {n: times[(case, n)] for n in workers}, costs.roofline(case, ceil)) for case in cases]}


def print_result(res: dict) -> None:
    c, gb = res["ceil"], 1e9
    print(f"\n### {res['label']}, build {res['build']}: file {res['file_bytes'] / gb:.2f} GB, "
          f"{res['weight_bytes'] / gb:.2f} GB of weights per decode step; read bandwidth {c['bw'] / gb:.1f} GB/s, "
          f"matmul peak {c['peak'] / 1e12:.2f} TFLOP/s ({c['peak_dtype']}) (medians of the run's "
          f"{len(res['ceils'])} measurements)\n")
    llama = "llama.cpp" in res["engines"]
    print("| case | radixgen | llama.cpp | radixgen / llama.cpp | roofline | radixgen % roof | llama.cpp % roof |")
    print("|---|---|---|---|---|---|---|")
    for case, med, _, roof in res["rows"]:
        ours, base = med["radixgen"], med.get("llama.cpp")
        print(f"| {LABELS[case]} | {ours:.1f} | {f'{base:.1f}' if llama else 'n/a'} | "
              f"{f'{ours / base:.2f}x' if llama else 'n/a'} | {roof:.1f} | {ours / roof:.0%} | "
              f"{f'{base / roof:.0%}' if llama else 'n/a'} |")
    load = " / ".join(f"{n} {s:.1f} s" for n, s in res["load_s"].items())
    rss = " / ".join(f"{n} {res['rss'][n] / gb:.2f} GB (peak {res['hwm'][n] / gb:.2f})" for n in res["engines"])
    print(f"\nload (warm page cache): {load}; resident memory after the run: {rss}")
    print(f"engines: {json.dumps(res['info'])}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", choices=("scale", "default"), default="scale",
                    help="scale: the random real-size files (--sizes, --types); default: the bundled SmolLM2-135M "
                         "GGUF as `make demo` loads it (cases b1,prefill512 unless --cases)")
    ap.add_argument("--sizes", default="1.7b", help=f"comma list of {', '.join(SHAPES)}")
    ap.add_argument("--types", default="Q4_0,Q4_K_M,Q8_0", help=f"comma list of {', '.join(FILE_TYPES)}")
    ap.add_argument("--cases", default=None, help=f"comma list of {', '.join(CASES)} (default: all)")
    ap.add_argument("--builds", default="native",
                    help="comma list of native, avx2 (radixgen with RADIXGEN_CPU_ISA=x86-64-v3, llama.cpp's "
                         "AVX2-only venv)")
    ap.add_argument("--reps", type=int, default=3, help="turns per case; the figures are medians")
    ap.add_argument("--steps", type=int, default=32, help="decode steps timed per turn")
    ap.add_argument("--quantization", default=None,
                    help="radixgen's quantization= for the file (default: gguf, its own blocks, for the scale "
                         "files; the Engine's default for --model default); 'default': pass none")
    ap.add_argument("--llama-venv", default="/work/llama/{build}",
                    help="llama-cpp-python venv per build ({build} is replaced by native / avx2)")
    ap.add_argument("--threads", type=int, default=0,
                    help="threads of both engines (radixgen's num_threads, llama.cpp's n_threads); default 0: every "
                         "core, radixgen's default")
    ap.add_argument("--no-llama", action="store_true", help="radixgen alone")
    ap.add_argument("--cache-dir", default=os.path.expanduser("~/.cache/radixgen/bench_scale"),
                    help="where the random GGUF files are written (and reused)")
    ap.add_argument("--delete", action="store_true", help="delete each written file after its run")
    ap.add_argument("--json", default=None, help="also write every figure to this JSON file")
    args = ap.parse_args()
    if args.cases is None:
        args.cases = "b1,prefill512" if args.model == "default" else ",".join(CASES)
    for c in args.cases.split(","):
        if c not in CASES:
            ap.error(f"unknown case {c!r}: choose from {', '.join(CASES)}")
    builds = args.builds.split(",")
    for b in builds:
        if b not in ISA:
            ap.error(f"unknown build {b!r}: native or avx2")
    print(f"CPU: {cpu_name()}; load average {os.getloadavg()[0]:.1f}; torch threads {torch.get_num_threads()}")
    files: list[tuple[str, Path, str]] = []  # (label, path, radixgen quantization)
    if args.model == "default":
        files.append(("SmolLM2-135M (bundled GGUF)", default_gguf_path(), args.quantization or "default"))
    else:
        cache = Path(args.cache_dir)
        cache.mkdir(parents=True, exist_ok=True)
        for size in args.sizes.split(","):
            if size not in SHAPES:
                ap.error(f"unknown size {size!r}: choose from {', '.join(SHAPES)}")
            for ft in args.types.split(","):
                if ft not in FILE_TYPES:
                    ap.error(f"unknown type {ft!r}: choose from {', '.join(FILE_TYPES)}")
                files.append((f"{SHAPES[size].name} {ft}", cache / f"{SHAPES[size].name}-{ft}.gguf",
                              args.quantization or "gguf"))
    results = []
    for label, path, quant in files:
        if not path.exists():
            shape = next(s for s in SHAPES.values() if label.startswith(s.name))
            print(f"writing {path} ...", flush=True)
            t = time.perf_counter()
            write_gguf(path, shape, label.rsplit(" ", 1)[1])
            print(f"  {path.stat().st_size / 1e9:.2f} GB in {time.perf_counter() - t:.0f} s", flush=True)
        for build in builds:
            res = run_file(label, path, build, args, quant)
            print_result(res)
            results.append(res)
        if args.delete and args.model != "default":
            path.unlink()
    if args.json:
        Path(args.json).write_text(json.dumps({"cpu": cpu_name(), "results": results}, indent=1))


if __name__ == "__main__":
    main()
