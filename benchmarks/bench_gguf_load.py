"""Loading a 1.7B-shaped Q4_K_M-like GGUF with quantization="gguf": seconds and resident memory.

Writes (once) a random file shaped like a 1.7B decoder (hidden 2048, 28 layers, 16 heads of 128, 8 KV heads, MLP
6144; the bundled model's tokenizer, so a 49k vocabulary): Q4_K q / k / o / gate / up, Q6_K v / down and the tied
embedding, random blocks with sane scales. Then, in fresh processes (the page cache warm after the first), builds a
ModelRunner on it and prints the seconds in load_weights and in the whole construction, and VmRSS against the file
size + the KV pool + 400 MB.

    python benchmarks/bench_gguf_load.py [--path /tmp/radixgen-1p7b-q4km.gguf] [--runs 2]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

HIDDEN, INTER, LAYERS, HEADS, KV_HEADS = 2048, 6144, 28, 16, 8
NAMES = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")


def blocks(t, rows: int, cols: int, gen: np.random.Generator) -> np.ndarray:
    import gguf

    size, nbytes = gguf.GGML_QUANT_SIZES[t]
    raw = gen.integers(0, 256, (rows, cols // size, nbytes), dtype=np.uint8)
    if t == gguf.GGMLQuantizationType.Q6_K:
        raw[..., 192:208] = gen.integers(-40, 40, raw.shape[:2] + (16,)).astype(np.int8).view(np.uint8)
        raw[..., 208:210] = np.full(raw.shape[:2] + (1,), 2e-4, np.float16).view(np.uint8)
    else:  # Q4_K: d, dmin
        raw[..., 0:2] = np.full(raw.shape[:2] + (1,), 1e-4, np.float16).view(np.uint8)
        raw[..., 2:4] = np.full(raw.shape[:2] + (1,), 7.5e-4, np.float16).view(np.uint8)
    return raw.reshape(rows, -1)


def write(path: Path) -> None:
    import gguf

    from radixgen.runtime.loader import default_gguf_path

    T = gguf.GGMLQuantizationType
    src = gguf.GGUFReader(str(default_gguf_path()))
    field = {k: src.fields[k].contents() for k in ("tokenizer.ggml.tokens", "tokenizer.ggml.token_type",
                                                   "tokenizer.ggml.merges", "tokenizer.ggml.bos_token_id",
                                                   "tokenizer.ggml.eos_token_id", "tokenizer.ggml.pre")}
    gen = np.random.default_rng(0)
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(LAYERS)
    w.add_context_length(4096)
    w.add_embedding_length(HIDDEN)
    w.add_feed_forward_length(INTER)
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV_HEADS)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_rope_freq_base(1e6)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(field["tokenizer.ggml.pre"])
    w.add_token_list(field["tokenizer.ggml.tokens"])
    w.add_token_types(field["tokenizer.ggml.token_type"])
    w.add_token_merges(field["tokenizer.ggml.merges"])
    w.add_bos_token_id(field["tokenizer.ggml.bos_token_id"])
    w.add_eos_token_id(field["tokenizer.ggml.eos_token_id"])
    vocab = len(field["tokenizer.ggml.tokens"])
    w.add_tensor("token_embd.weight", blocks(T.Q6_K, vocab, HIDDEN, gen), raw_dtype=T.Q6_K)
    w.add_tensor("output_norm.weight", np.ones(HIDDEN, np.float32))
    kv = KV_HEADS * HIDDEN // HEADS
    shapes = [(HIDDEN, HIDDEN), (kv, HIDDEN), (kv, HIDDEN), (HIDDEN, HIDDEN), (INTER, HIDDEN), (INTER, HIDDEN),
              (HIDDEN, INTER)]
    types = (T.Q4_K, T.Q4_K, T.Q6_K, T.Q4_K, T.Q4_K, T.Q4_K, T.Q6_K)
    for i in range(LAYERS):
        w.add_tensor(f"blk.{i}.attn_norm.weight", np.ones(HIDDEN, np.float32))
        w.add_tensor(f"blk.{i}.ffn_norm.weight", np.ones(HIDDEN, np.float32))
        for name, t, (rows, cols) in zip(NAMES, types, shapes, strict=True):
            w.add_tensor(f"blk.{i}.{name}.weight", blocks(t, rows, cols, gen), raw_dtype=t)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def measure(path: str) -> None:
    """One load in this process: a JSON line of seconds and bytes."""
    from radixgen.runtime.config import RuntimeConfig
    from radixgen.runtime.executor import model_runner

    spent = {}
    inner = model_runner.load_weights

    def timed(*a, **kw):
        t0 = time.perf_counter()
        inner(*a, **kw)
        spent["load_weights_s"] = time.perf_counter() - t0

    model_runner.load_weights = timed
    t0 = time.perf_counter()
    r = model_runner.ModelRunner(RuntimeConfig(model=path, dtype="bfloat16", quantization="gguf",
                                               max_total_tokens=4096, max_running_requests=4))
    spent["runner_s"] = time.perf_counter() - t0
    rss = next(int(ln.split()[1]) * 1024 for ln in open("/proc/self/status") if ln.startswith("VmRSS"))
    print(json.dumps({**spent, "rss": rss, "file": Path(path).stat().st_size, "kv_pool": r.kv_pool.nbytes(),
                      "methods": r.ops.linear_methods(r.model)}))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--path", default="/tmp/radixgen-1p7b-q4km.gguf")
    ap.add_argument("--runs", type=int, default=2)
    ap.add_argument("--measure", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.measure:
        measure(a.path)
        return
    path = Path(a.path)
    if not path.exists():
        t0 = time.perf_counter()
        write(path)
        print(f"wrote {path} ({path.stat().st_size / 2**30:.2f} GiB) in {time.perf_counter() - t0:.0f} s")
    for run in range(a.runs):
        out = subprocess.run([sys.executable, __file__, "--path", str(path), "--measure"], capture_output=True,
                             text=True, check=True)
        m = json.loads(out.stdout.strip().splitlines()[-1])
        budget = m["file"] + m["kv_pool"] + 400 * 2**20
        print(f"run {run}: load_weights {m['load_weights_s']:.2f} s, runner {m['runner_s']:.2f} s, "
              f"RSS {m['rss'] / 2**20:.0f} MiB (file {m['file'] / 2**20:.0f} MiB + KV {m['kv_pool'] / 2**20:.0f} "
              f"MiB + 400 MiB = {budget / 2**20:.0f} MiB), {', '.join(m['methods'])}")


if __name__ == "__main__":
    main()
