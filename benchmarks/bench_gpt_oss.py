"""gpt-oss decode at batch 1 from a random gpt-oss-20b-shaped GGUF file (llama.cpp's layout: MXFP4 experts, Q8_0
attention, embedding and LM head, float32 norms, biases, sinks and router), run by radixgen from the file's own
blocks (quantization="gguf": the MXFP4 experts as the file stores them, one C matmul per expert) and by llama.cpp
(llama-cpp-python in its own venv, a subprocess) on the same file with the same threads: load time, resident
memory, tok/s of single-token decode steps over a short context, and the % of the roofline each reaches, the
roofline being the machine's read bandwidth (a 512 MiB tensor's sum, measured in this run, as bench_scale.py
does) over the bytes a token reads (its 4 routed experts of 32, the attention, the router, the LM head: in the
file's layout, and in the layout our kernels keep).

The full 20b shape (24 layers, a 12.1 GB file) by default; the file is written once, streamed tensor by tensor,
to /tmp/scale (reused by later runs; --layers N writes a smaller one):

    python benchmarks/bench_gpt_oss.py [--layers 24] [--tokens 32] [--threads 2] [--llama /work/llama/native]
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import torch

# gpt-oss-20b's shape (its config.json)
SHAPE = dict(hidden=2880, heads=64, kv_heads=8, head_dim=64, experts=32, top_k=4, intermediate=2880, vocab=201088,
             window=128, rope_theta=150000.0, yarn_factor=32.0, yarn_ctx=4096, layers=24)
Q8_0_BYTES, MXFP4_BYTES = 34, 17  # per block of 32 values


def q8_0(rows: int, cols: int, rng) -> np.ndarray:
    """Random Q8_0 blocks (rows, cols / 32 * 34): a small f16 scale, int8 values."""
    raw = rng.integers(0, 256, (rows, cols // 32, Q8_0_BYTES), dtype=np.uint8)
    raw[..., :2] = np.array([2e-4], np.float16).view(np.uint8)
    return raw.reshape(rows, -1)


def mxfp4(experts: int, rows: int, cols: int, rng) -> np.ndarray:
    """Random MXFP4 blocks (E, rows, cols / 32 * 17): an exponent byte of 2^-6, 16 bytes of FP4 codes."""
    raw = rng.integers(0, 256, (experts, rows, cols // 32, MXFP4_BYTES), dtype=np.uint8)
    raw[..., 0] = 127 - 6
    return raw.reshape(experts, rows, -1)


def byte_level_vocab(n: int) -> list[str]:
    """The 256 byte-level BPE symbols, one merged token, and fillers up to `n` entries."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    shifted = iter(range(256, 512))
    tokens = [chr(b) if b in printable else chr(next(shifted)) for b in range(256)] + ["!!"]
    return tokens + [f"[{k}]" for k in range(n - len(tokens))]


def token_bytes(layers: int) -> dict:
    """The bytes a decode token reads in the file, per part."""
    s = SHAPE
    h, hd, e, i = s["hidden"], s["head_dim"], s["experts"], s["intermediate"]
    q, kv = s["heads"] * hd, s["kv_heads"] * hd
    attn = sum(rows * cols // 32 * Q8_0_BYTES + rows * 4 for rows, cols in ((q, h), (kv, h), (kv, h), (h, q)))
    expert = 3 * h * i // 32 * MXFP4_BYTES
    return {"attention": layers * attn, "router": layers * e * h * 4, "experts": layers * s["top_k"] * expert,
            "lm_head": s["vocab"] * h // 32 * Q8_0_BYTES}


def write_file(path: Path, layers: int) -> None:
    """The GGUF file, each tensor generated and written in turn (a 12 GB file never in memory at once)."""
    import gguf

    s, rng = SHAPE, np.random.default_rng(0)
    h, hd, e, i = s["hidden"], s["head_dim"], s["experts"], s["intermediate"]
    q, kv = s["heads"] * hd, s["kv_heads"] * hd
    w = gguf.GGUFWriter(str(path), "gpt-oss")
    w.add_block_count(layers)
    w.add_context_length(131072)
    w.add_embedding_length(h)
    w.add_feed_forward_length(i)
    w.add_head_count(s["heads"])
    w.add_head_count_kv(s["kv_heads"])
    w.add_key_length(hd)
    w.add_value_length(hd)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_freq_base(s["rope_theta"])
    w.add_sliding_window(s["window"])
    w.add_expert_count(e)
    w.add_expert_used_count(s["top_k"])
    w.add_expert_feed_forward_length(i)
    w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
    w.add_rope_scaling_factor(s["yarn_factor"])
    w.add_rope_scaling_orig_ctx_len(s["yarn_ctx"])
    # a byte-level vocabulary padded to the model's 201088 entries (llama.cpp wants one token per embedding row)
    tokens = byte_level_vocab(s["vocab"])
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types([1] * len(tokens))
    w.add_token_merges(["! !"])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    Q8, MX = gguf.GGMLQuantizationType.Q8_0, gguf.GGMLQuantizationType.MXFP4

    def f32(*shape):
        return lambda: (rng.standard_normal(shape, dtype=np.float32) * 0.02).astype(np.float32)

    def ones(n):
        return lambda: np.ones(n, np.float32)

    # (name, make the array, its GGML type or None for float32, its shape in bytes / values)
    specs = [("token_embd.weight", lambda: q8_0(s["vocab"], h, rng), Q8, (s["vocab"], h // 32 * Q8_0_BYTES)),
             ("output_norm.weight", ones(h), None, (h,)),
             ("output.weight", lambda: q8_0(s["vocab"], h, rng), Q8, (s["vocab"], h // 32 * Q8_0_BYTES))]
    for b in range(layers):
        p = f"blk.{b}."
        specs += [(p + n, ones(h), None, (h,)) for n in ("attn_norm.weight", "post_attention_norm.weight")]
        for name, rows, cols in (("attn_q", q, h), ("attn_k", kv, h), ("attn_v", kv, h), ("attn_output", h, q)):
            specs += [(p + name + ".weight", lambda r=rows, c=cols: q8_0(r, c, rng), Q8,
                       (rows, cols // 32 * Q8_0_BYTES)),
                      (p + name + ".bias", f32(rows), None, (rows,))]
        specs += [(p + "attn_sinks.weight", f32(s["heads"]), None, (s["heads"],)),
                  (p + "ffn_gate_inp.weight", f32(e, h), None, (e, h)), (p + "ffn_gate_inp.bias", f32(e), None, (e,))]
        for name, rows, cols in (("ffn_gate_exps", i, h), ("ffn_up_exps", i, h), ("ffn_down_exps", h, i)):
            specs += [(p + name + ".weight", lambda r=rows, c=cols: mxfp4(e, r, c, rng), MX,
                       (e, rows, cols // 32 * MXFP4_BYTES)),
                      (p + name + ".bias", f32(e, rows), None, (e, rows))]
    for name, _, kind, shape in specs:
        dtype = np.float32 if kind is None else np.uint8
        w.add_tensor_info(name, shape, np.dtype(dtype), int(np.prod(shape)) * np.dtype(dtype).itemsize, raw_dtype=kind)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    for _, make, _, _ in specs:
        w.write_tensor_data(make())
    w.close()


def rss() -> dict:
    """This process's resident memory (VmRSS, VmHWM: its peak; RssAnon, RssFile: private vs file-backed pages)."""
    out = {}
    for line in open("/proc/self/status"):
        key = line.split(":")[0]
        if key in ("VmRSS", "VmHWM", "RssAnon", "RssFile"):
            out[key] = int(line.split()[1]) * 1024
    return out


def warm_page_cache(path: Path) -> float:
    """Read the whole file once (seconds taken): both engines map it, and a token's experts are a random 4 of 32
    per layer, so without this the first tokens read their experts from the disk, not from memory."""
    t = time.perf_counter()
    with open(path, "rb", buffering=0) as f:
        while f.read(64 << 20):
            pass
    return time.perf_counter() - t


def read_bandwidth() -> float:
    big = torch.ones(128 << 20, dtype=torch.float32)  # 512 MiB, far past the caches
    best = min(_timed(big.sum) for _ in range(5))
    return big.numel() * 4 / best


def _timed(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def ours(path: Path, tokens: int, prompt: int) -> tuple[list[float], dict, dict]:
    """Seconds of each decode step (one request, after a `prompt`-token prefill), the bytes a token reads in the
    layouts the loaded model keeps, and the load's seconds and resident memory."""
    from radixgen.runtime.config import RuntimeConfig
    from radixgen.runtime.executor.model_runner import ForwardInput, ModelRunner
    from radixgen.runtime.layers.linear import LinearBase
    from radixgen.runtime.layers.quantization.experts import GroupedLinear
    from radixgen.runtime.scheduler.kv_manager import KVCacheManager

    t0 = time.perf_counter()
    runner = ModelRunner(RuntimeConfig(model=str(path), quantization="gguf", max_total_tokens=prompt + tokens + 64,
                                       max_running_requests=1, context_length=prompt + tokens + 64))
    load = {"load_s": time.perf_counter() - t0, "rss_loaded": rss()}
    kv = KVCacheManager.for_runner(runner)
    slots = kv.allocator.allocate(prompt + tokens)
    kv.table.write(0, 0, slots)
    rng = torch.Generator().manual_seed(1)
    ids = torch.randint(3, 50000, (prompt + tokens,), generator=rng)
    runner.forward(ForwardInput(ids[:prompt], torch.arange(prompt), slots[:prompt], torch.tensor([0]), [0], [prompt],
                                torch.tensor([prompt - 1])))
    times = []
    for p in range(prompt, prompt + tokens):
        fi = ForwardInput(ids[p:p + 1], torch.tensor([p]), slots[p:p + 1], torch.tensor([0]), [p], [1],
                          torch.tensor([0]))
        times.append(_timed(lambda fi=fi: runner.forward(fi)))
    model, nbytes = runner.model, {"attention": 0, "router": 0, "experts": 0, "lm_head": 0}
    for name, m in model.named_modules():
        if isinstance(m, GroupedLinear):
            nbytes["experts"] += m.method.nbytes(m) * SHAPE["top_k"] // m.num_experts
        elif isinstance(m, LinearBase):
            nbytes["lm_head" if "lm_head" in name else "attention"] += m.method.nbytes(m)
        elif name.endswith("mlp.router"):
            nbytes["router"] += sum(t.numel() * t.element_size() for t in m.parameters())
    load["rss_after"] = rss()
    load["methods"] = sorted({m.method.name for m in model.modules() if isinstance(m, GroupedLinear)})
    return times, nbytes, load


LLAMA_SCRIPT = """
import json, sys, time
import numpy as np
from llama_cpp import Llama
path, tokens, prompt, threads = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
t0 = time.perf_counter()
llm = Llama(model_path=path, n_ctx=prompt + tokens + 64, n_threads=threads, n_threads_batch=threads, n_batch=prompt,
            n_gpu_layers=0, verbose=False)
load_s = time.perf_counter() - t0
ids = np.random.default_rng(1).integers(3, 50000, prompt + tokens).tolist()
llm.eval(ids[:prompt])
times = []
for t in ids[prompt:]:
    s = time.perf_counter()
    llm.eval([t])
    times.append(time.perf_counter() - s)
mem = {l.split(":")[0]: int(l.split()[1]) * 1024 for l in open("/proc/self/status") if l.startswith(("VmRSS", "VmHWM"))}
print(json.dumps({"times": times, "load_s": load_s, "rss": mem}))
"""


def llama_cpp(build: Path, path: Path, tokens: int, prompt: int, threads: int) -> dict | str:
    """Seconds of each llama.cpp decode step, its load time and resident memory, or why there are none."""
    python = build / "bin" / "python"
    if not python.is_file():
        return f"no llama.cpp build at {build}"
    try:
        out = subprocess.run([str(python), "-c", LLAMA_SCRIPT, str(path), str(tokens), str(prompt), str(threads)],
                             capture_output=True, text=True, timeout=600)
    except subprocess.TimeoutExpired:
        return "llama.cpp ran past 10 minutes"
    if out.returncode != 0:
        return f"llama.cpp failed: {out.stderr.strip().splitlines()[-1:] or out.returncode}"
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=SHAPE["layers"])
    ap.add_argument("--tokens", type=int, default=32, help="decode steps timed")
    ap.add_argument("--prompt", type=int, default=32, help="prefill tokens before them")
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--llama", type=Path, default=Path("/work/llama/native"), help="llama-cpp-python venv")
    ap.add_argument("--dir", type=Path, default=Path("/tmp/scale"), help="where the file is written (and reused)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    args.dir.mkdir(parents=True, exist_ok=True)
    path = args.dir / f"gpt-oss-20b-shape-{args.layers}l-mxfp4.gguf"
    t = time.perf_counter()
    if not path.exists():
        part = path.with_suffix(".part")
        write_file(part, args.layers)
        part.rename(path)
        print(f"wrote {path} in {time.perf_counter() - t:.0f} s")
    file_bytes = token_bytes(args.layers)
    print(f"file: {path} ({path.stat().st_size / 1e9:.2f} GB, {args.layers} of 24 layers)")
    bw = read_bandwidth()
    print(f"page cache warmed in {warm_page_cache(path):.0f} s")
    ours_times, ours_bytes, load = ours(path, args.tokens, args.prompt)
    gc.collect()  # our model's memory back before llama.cpp maps the file
    print(f"page cache warmed in {warm_page_cache(path):.0f} s")
    llama = llama_cpp(args.llama, path, args.tokens, args.prompt, args.threads)
    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")),
               "?")
    gb = 1e9
    print(f"CPU: {cpu}, {args.threads} threads; read bandwidth {bw / gb:.1f} GB/s; experts: "
          f"{', '.join(load['methods'])}")
    r0, r1 = load["rss_loaded"], load["rss_after"]
    print(f"radixgen: load {load['load_s']:.1f} s; resident after load {r0['VmRSS'] / gb:.2f} GB (anon "
          f"{r0['RssAnon'] / gb:.2f}, file-backed {r0['RssFile'] / gb:.2f}), after decode {r1['VmRSS'] / gb:.2f} GB "
          f"(anon {r1['RssAnon'] / gb:.2f}, file {r1['RssFile'] / gb:.2f}), peak {r1['VmHWM'] / gb:.2f} GB")
    rows = [("radixgen (quantization=gguf)", ours_times, ours_bytes)]
    if isinstance(llama, str):
        print(f"llama.cpp: {llama}")
    else:
        print(f"llama.cpp: load {llama['load_s']:.1f} s; resident after decode {llama['rss']['VmRSS'] / gb:.2f} GB "
              f"(peak {llama['rss']['VmHWM'] / gb:.2f} GB)")
        rows.append(("llama.cpp", llama["times"], file_bytes))
    print(f"b1 decode, {args.tokens} tokens after a {args.prompt}-token prompt; roofline = bandwidth / bytes a "
          f"token reads")
    for name, times, nbytes in rows:
        best, med = min(times), float(np.median(times))
        line = f"  {name:<30} median {1 / med:6.2f} tok/s  best {1 / best:6.2f} tok/s"
        for what, b in (("file layout", file_bytes), ("own layout", nbytes if name.startswith("radix") else None)):
            if b:
                total = sum(b.values())
                line += f" | {what}: {total / 1e6:7.1f} MB/token, {100 * total / med / bw:5.1f}% of roofline"
        print(line)
    print("  bytes a token reads in the file: " + ", ".join(f"{k} {v / 1e6:.1f} MB" for k, v in file_bytes.items()))
    print("  in our layout: " + ", ".join(f"{k} {v / 1e6:.1f} MB" for k, v in ours_bytes.items()))


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).parent))
    main()
