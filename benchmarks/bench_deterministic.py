"""What the deterministic mode costs: decode steps at batch 1 and 8 over 256-token contexts and a 512-token prefill,
with the mode on and off (the default kernels) in one run, per build of the CPU kernels this CPU can run (native,
and the emulated older CPUs: x86-64-v3 is an AVX2 CPU, skylake-avx512 one with AVX-512 but no BF16), on the bundled
default model (bf16) and on a GGUF file shaped like a 1.7B Llama (hidden 2048, MLP 8192, 32 heads, the default
model's vocabulary; Q4_K with Q6_K for attn_v, ffn_down and the tied embedding, as Q4_K_M mixes them) whose blocks
are random, written once into --gguf-dir. Each build runs in its own process (RADIXGEN_CPU_ISA is read once). The two
runners take turns inside each round, so both meet the same machine; each figure is the best of its rounds.

    python benchmarks/bench_deterministic.py [--models default,gguf] [--builds native,x86-64-v3,skylake-avx512]
        [--batches 1,8] [--prefill 512] [--ctx 256] [--reps 4] [--layers 24]

--layers cuts the GGUF's depth (every layer has the 1.7B shapes: the ratios hold, the run gets shorter).
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

import numpy as np
import torch

HIDDEN, INTER, HEADS, QK = 2048, 8192, 32, 256
BYTES = {"Q4_K": 144, "Q6_K": 210}


def _blocks(rng, t: str, rows: int, cols: int) -> np.ndarray:
    """(rows, cols) of GGUF type t as stored: random bytes with sane fp16 scales (weights about zero-mean)."""
    raw = rng.integers(0, 256, (rows, cols // QK, BYTES[t]), dtype=np.uint8)
    if t == "Q6_K":
        raw[..., 192:208] = rng.integers(-40, 40, (rows, cols // QK, 16)).astype(np.int8).view(np.uint8)
        raw[..., 208:210] = np.full((rows, cols // QK, 1), 2e-4, np.float16).view(np.uint8)
    else:
        raw[..., 0:4] = np.array([[[1e-4, 7.5e-4]]], np.float16).view(np.uint8)
    return raw.reshape(rows, -1)


def write_gguf(path: Path, layers: int) -> None:
    """The 1.7B-shaped GGUF of `layers` layers, with the default model's tokenizer."""
    import gguf

    from radixgen.runtime.loader import default_gguf_path

    src = gguf.GGUFReader(str(default_gguf_path()))
    f = {k: src.fields[k].contents() for k in ("tokenizer.ggml.tokens", "tokenizer.ggml.token_type",
                                               "tokenizer.ggml.merges", "tokenizer.ggml.bos_token_id",
                                               "tokenizer.ggml.eos_token_id", "tokenizer.ggml.pre")}
    T = gguf.GGMLQuantizationType
    rng = np.random.default_rng(0)
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(layers)
    w.add_context_length(2048)
    w.add_embedding_length(HIDDEN)
    w.add_feed_forward_length(INTER)
    w.add_head_count(HEADS)
    w.add_head_count_kv(HEADS)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_freq_base(130000.0)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(f["tokenizer.ggml.pre"])
    w.add_token_list(f["tokenizer.ggml.tokens"])
    w.add_token_types(f["tokenizer.ggml.token_type"])
    w.add_token_merges(f["tokenizer.ggml.merges"])
    w.add_bos_token_id(f["tokenizer.ggml.bos_token_id"])
    w.add_eos_token_id(f["tokenizer.ggml.eos_token_id"])

    def add(name, t, rows, cols):
        w.add_tensor(name, _blocks(rng, t, rows, cols), raw_dtype=getattr(T, t))

    add("token_embd.weight", "Q6_K", len(f["tokenizer.ggml.tokens"]), HIDDEN)
    w.add_tensor("output_norm.weight", np.ones(HIDDEN, np.float32))
    for i in range(layers):
        w.add_tensor(f"blk.{i}.attn_norm.weight", np.ones(HIDDEN, np.float32))
        w.add_tensor(f"blk.{i}.ffn_norm.weight", np.ones(HIDDEN, np.float32))
        for name, t, rows, cols in (("attn_q", "Q4_K", HIDDEN, HIDDEN), ("attn_k", "Q4_K", HIDDEN, HIDDEN),
                                    ("attn_v", "Q6_K", HIDDEN, HIDDEN), ("attn_output", "Q4_K", HIDDEN, HIDDEN),
                                    ("ffn_gate", "Q4_K", INTER, HIDDEN), ("ffn_up", "Q4_K", INTER, HIDDEN),
                                    ("ffn_down", "Q6_K", HIDDEN, INTER)):
            add(f"blk.{i}.{name}.weight", t, rows, cols)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


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


def one_build(args) -> None:
    """This process's build (RADIXGEN_CPU_ISA): the rows of every model asked for."""
    from bench_forward import OurModel

    from radixgen.runtime.loader import resolve_model_path

    batches = [int(b) for b in args.batches.split(",")]
    build = os.environ.get("RADIXGEN_CPU_ISA") or "native"
    for name in args.models.split(","):
        if name == "default":
            path, kw = resolve_model_path(None), {}
        else:
            folder = Path(args.gguf_dir)
            folder.mkdir(parents=True, exist_ok=True)
            path, kw = folder / f"llama-1.7b-shaped-{args.layers}l.gguf", dict(quantization="gguf")
            if not path.exists():
                tmp = path.with_suffix(f".{os.getpid()}.tmp")
                write_gguf(tmp, args.layers)
                tmp.replace(path)
        models = {mode: OurModel(path, "bfloat16", max(batches), args.ctx, deterministic=mode == "on", **kw)
                  for mode in ("off", "on")}
        label = f"{build:14} {name:8}"
        ids = torch.randint(0, 1000, (args.prefill,)).tolist()
        prefills = {mode: (lambda m=m, ids=ids: m.prefill(ids)) for mode, m in models.items()}
        best = turns(prefills, max(1, args.reps // 2))
        rows = [(f"prefill {args.prefill}", args.prefill / best["off"], args.prefill / best["on"])]
        for b in batches:
            fis = {mode: m.setup_decode(b, args.ctx) for mode, m in models.items()}
            best = turns({mode: (lambda m=m, fi=fis[mode]: m.runner.forward(fi)) for mode, m in models.items()},
                         args.reps * 2)
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
    ap.add_argument("--gguf-dir", default=str(Path.home() / ".cache" / "radixgen" / "bench"))
    ap.add_argument("--one-build", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.one_build:
        one_build(args)
        return
    from radixgen.kernels import _cpu_build

    print(f"CPU: {_cpu_build.cpu_model()}, torch threads: {torch.get_num_threads()}")
    print(f"{'build':14} {'model':8} {'case':12} {'default tok/s':>14} {'deterministic':>14} {'ratio':>7}", flush=True)
    for build in args.builds.split(","):
        missing = _cpu_build.missing_flags(build)
        if missing:
            print(f"{build:14} skipped: this CPU lacks {', '.join(missing)}")
            continue
        env = {**os.environ, "RADIXGEN_CPU_ISA": build}
        subprocess.run([sys.executable, __file__, "--one-build", *sys.argv[1:]], env=env, check=True)
    print("\ndeterministic: every attention query over fixed pieces of its context, prefill queries as decode\n"
          "queries, int8 / int4 matmuls in calls of at most 16 rows (runtime/deterministic.py); default: the split "
          "follows\nthe batch, prefill runs the extend kernel and the GEMMs.")


if __name__ == "__main__":
    main()
