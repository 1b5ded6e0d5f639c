"""Quantized weights on the CPU: the bundled model in bf16 (its GGUF dequantized, the default), int8 (quantized
at load from that bf16) and int4 (the GGUF's own Q4_1 blocks, quantization="gguf"), in one run: decode steps at
batch 1 and 8 over 256-token contexts and a 1024-token prefill (the engines taking turns inside each measurement
window, and with them the machine's memory bandwidth, from a copy and a sum), the scheduler process's resident
memory against the weights' bytes, and perplexity on a fixed text written for this benchmark
(data/quant_text.txt). The int8 KV cache's row comes from benchmarks/bench_kv_cache.py (`kv_cache_row`: its
decode, prefill, capacity and perplexity against the bf16 cache, also taking turns, in this run). Then issue 15's
targets, each checked on figures of this run.

    python benchmarks/bench_quant.py [--quick] [--reps N] [--windows N]
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import time
from pathlib import Path

os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")  # as the Engine's scheduler process does (before torch loads)

import torch
from bench_forward import OurModel
from bench_kv_cache import kv_cache_row

from radixgen.runtime.executor.model_runner import ForwardInput
from radixgen.runtime.ground.kv_pool import KVPool
from radixgen.runtime.layers import quantization
from radixgen.runtime.layers.linear import LinearBase
from radixgen.runtime.loader import load_tokenizer, resolve_model_path

TEXT = Path(__file__).parent / "data" / "quant_text.txt"
CTX, PREFILL, WINDOW = 256, 1024, 1024  # decode contexts, prefill length, perplexity window (tokens)
KV_SLOTS = 8 * (CTX + 16) + 2048  # the pool of every engine here


def engine_cases() -> dict[str, dict]:
    """The engines compared: name -> RuntimeConfig fields over the bundled model (bf16 activations throughout).
    "bf16" is the reference of the others' targets."""
    return {
        "bf16": {},
        "int8": {"quantization": "int8"},
        "int4": {"quantization": "gguf"},
    }


def matmul_bytes(runner) -> int:
    """What a decode step streams of the weights: every linear layer's layout (the tied LM head once)."""
    return sum(m.method.nbytes(m) for m in runner.model.modules() if isinstance(m, LinearBase))


STREAM_BYTES = 256 << 20  # the bandwidth references stream this many bytes, far beyond the caches


def timed_windows(fns: dict, reps: int, n_windows: int) -> list[dict]:
    """Per window: each engine's best time and the machine's memory bandwidth, all taking turns, one run each,
    `reps` rounds: {"t": engine -> seconds, "rates": {"copy": bytes/s, "sum": bytes/s}}. The bandwidth is the
    better of a copy (its bytes read and written) and a sum (bytes read, as the weights are), each the best of as
    many runs, taken between the same steps so that it sees what they see: measured apart, before and after a
    window, a copy read up to 70 GB/s on this shared machine beside steps that streamed at 45."""
    src = torch.ones(STREAM_BYTES // 4, dtype=torch.float32)
    dst = torch.empty_like(src)
    refs = {("copy", 2 * STREAM_BYTES): lambda: dst.copy_(src), ("sum", STREAM_BYTES): src.sum}
    turns = {**fns, **refs}
    for fn in turns.values():
        fn()  # warm-up
    out = []
    for _ in range(n_windows):
        best = dict.fromkeys(turns, math.inf)
        for _ in range(reps):
            for name, fn in turns.items():
                t0 = time.perf_counter()
                fn()
                best[name] = min(best[name], time.perf_counter() - t0)
        rates = {what: nbytes / best.pop((what, nbytes)) for what, nbytes in refs}  # best: the engines' alone now
        out.append({"t": best, "rates": rates})
    return out


def perplexity(model: OurModel, ids: list[int]) -> float:
    """exp(mean next-token NLL) over `ids`, in independent windows of WINDOW tokens."""
    r, nll, count = model.runner, 0.0, 0
    for lo in range(0, len(ids) - 1, WINDOW):
        chunk = ids[lo:lo + WINDOW + 1]
        model.kv.allocator.reset()
        n = len(chunk) - 1
        slots = model.kv.allocator.allocate(n)
        model.kv.table.write(0, 0, slots)
        logits = r.forward(ForwardInput(torch.tensor(chunk[:-1]), torch.arange(n), slots, torch.tensor([0]), [0],
                                        [n], torch.arange(n)))
        nll += torch.nn.functional.cross_entropy(logits.float(), torch.tensor(chunk[1:]), reduction="sum").item()
        count += n
    return math.exp(nll / count)


def decode_perplexity(model: OurModel, ids: list[int]) -> float:
    """The same over decode steps: `ids` fed one token per step (batch 1, the fused decode step), each step's logits
    scoring the next token. Prefill dequantizes quantized weights to bf16 a tile at a time; decode steps compute
    with the exact values, in registers: this is their accuracy."""
    r, n = model.runner, len(ids) - 1
    model.kv.allocator.reset()
    slots = model.kv.allocator.allocate(n)
    model.kv.table.write(0, 0, slots)
    nll = 0.0
    for i in range(n):
        logits = r.forward(ForwardInput(torch.tensor(ids[i:i + 1]), torch.tensor([i]), slots[i:i + 1],
                                        torch.tensor([0]), [i], [1], torch.tensor([0])))
        nll += torch.nn.functional.cross_entropy(logits.float(), torch.tensor(ids[i + 1:i + 2])).item()
    return math.exp(nll / n)


FLOOR = """
import psutil, torch
from radixgen.runtime.config import RuntimeConfig
from radixgen.runtime.loader import load_tokenizer
from radixgen.runtime.scheduler.process import _make_grammar_backend
tok = load_tokenizer(None)
grammar = _make_grammar_backend(RuntimeConfig(), tok, len(tok), (tok.eos_token_id,))
from radixgen.runtime.executor.model_runner import release_free_heap
release_free_heap()  # as the scheduler process does once it has started
print(psutil.Process().memory_info().rss)
"""


def process_floor() -> int:
    """The resident bytes of a process holding what a scheduler process holds besides a model: torch, the
    tokenizer, the grammar backend."""
    import subprocess
    import sys

    return int(subprocess.run([sys.executable, "-c", FLOOR], capture_output=True, text=True, check=True).stdout)


def resident_memory(config: dict) -> tuple[int, int, int]:
    """(the scheduler process's resident bytes after a short generation, its weights' bytes, its KV pool's bytes)
    for an Engine of `config`."""
    import psutil

    from radixgen.runtime.engine import Engine

    with Engine(dtype="bfloat16", max_total_tokens=KV_SLOTS, max_running_requests=8, **config) as eng:
        eng.generate("The lighthouse keeper", {"max_new_tokens": 8, "temperature": 0})
        rss = psutil.Process(eng._client._proc.popen.pid).memory_info().rss  # the scheduler process
        info = eng.get_server_info()["memory"]
    return rss, info["weight_bytes"], info["kv_pool_bytes"]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--windows", type=int, default=3, help="measurement windows per case")
    ap.add_argument("--quick", action="store_true", help="fewer repetitions, one window, perplexity on 1024 tokens")
    args = ap.parse_args()
    reps, n_windows = (2, 1) if args.quick else (args.reps, args.windows)
    cases = engine_cases()
    print(f"torch threads: {torch.get_num_threads()}; engines: {', '.join(cases)}")
    engines = {name: OurModel(resolve_model_path(None, cfg.get("quantization", "auto")), "bfloat16", 8, CTX, **cfg)
               for name, cfg in cases.items()}
    for name, e in engines.items():
        print(f"  {name}: linear layers {', '.join(e.runner.ops.linear_methods(e.runner.model))}; "
              f"weights {quantization.weight_bytes(e.runner.model) / 1e6:.1f} MB; decode steps "
              f"{'fused (one C call)' if e.runner.fused_decode is not None else 'layer by layer (no fused step here)'}")
    mc = next(iter(engines.values())).runner.model_config
    kv_per_token = KVPool.bytes_per_slot(mc.num_layers, mc.num_kv_heads, mc.head_dim, torch.bfloat16)

    rows = {}  # case -> {engine: (tok/s best, windows)}
    ids = torch.randint(0, 1000, (PREFILL,), generator=torch.Generator().manual_seed(0)).tolist()
    w = timed_windows({n: (lambda e=e: e.prefill(ids)) for n, e in engines.items()}, max(1, reps // 2), n_windows)
    rows[f"prefill {PREFILL}"] = (PREFILL, w, None)
    for b in (1, 8):
        fis = {n: e.setup_decode(b, CTX) for n, e in engines.items()}
        w = timed_windows({n: (lambda e=e, fi=fis[n]: e.runner.forward(fi)) for n, e in engines.items()}, reps * 4,
                          n_windows)
        rows[f"decode b={b}"] = (b, w, {n: matmul_bytes(e.runner) + kv_per_token * b * CTX for n, e in engines.items()})

    print(f"\n{'case':13} {'engine':7} {'tok/s':>9} {'vs bf16':>8} {'GB moved':>9} {'of roofline':>12} (copy/sum GB/s)")
    figures = {}
    for case, (tokens, windows, nbytes) in rows.items():
        for name in engines:
            best = tokens / min(win["t"][name] for win in windows)
            figures[(case, name)] = best
            line = f"{case:13} {name:7} {best:9.1f} {best / figures[(case, 'bf16')]:7.2f}x"
            if nbytes is not None:  # decode: bandwidth-bound; each window's time against its own bandwidth
                fracs = sorted(nbytes[name] / win["t"][name] / max(win["rates"].values()) for win in windows)
                figures[(case, name, "roof")] = statistics.median(fracs)
                bws = ", ".join("/".join(f"{r / 1e9:.1f}" for r in win["rates"].values()) for win in windows)
                line += f" {nbytes[name] / 1e9:9.3f} {statistics.median(fracs):11.1%}  ({bws})"
            print(line)

    text_ids = load_tokenizer(None)(TEXT.read_text()).input_ids
    ppl = {name: perplexity(e, text_ids[:WINDOW + 1 if args.quick else None]) for name, e in engines.items()}
    steps = 128 if args.quick else 512
    dppl = {name: decode_perplexity(e, text_ids[:steps + 1]) for name, e in engines.items()}
    for what, p, n in (("prefill", ppl, min(len(text_ids), WINDOW + 1) if args.quick else len(text_ids)),
                       ("decode steps", dppl, steps + 1)):
        print(f"perplexity on {TEXT.name}, {what} ({n} tokens): "
              + ", ".join(f"{name} {v:.3f} ({v / p['bf16'] - 1:+.2%})" for name, v in p.items()))

    engines = None  # free the in-process models before the KV cache's and the Engines start
    kv8 = kv_cache_row("int8", args.quick)
    print("\nint8 KV cache (bf16 weights) against the bf16 cache, taking turns (bench_kv_cache.kv_cache_row):")
    for key in sorted(k for k in kv8 if k.startswith("decode") and k.endswith("tok_s")):
        case = key.removesuffix("_tok_s")
        print(f"  {case:22} {kv8[key]:8.1f} tok/s  {kv8[case + '_vs_bf16']:.2f}x the bf16 cache")
    print(f"  {'prefill_1024':22} {kv8['prefill_1024_tok_s']:8.1f} tok/s  {kv8['prefill_1024_vs_bf16']:.2f}x the bf16 "
          f"cache")
    print(f"  capacity at 2 GiB {kv8['capacity_tokens_2gb']} tokens, {kv8['capacity_vs_bf16']:.2f}x the bf16 cache's; "
          f"perplexity {kv8['ppl']:.3f} against {kv8['ppl_bf16']:.3f} ({kv8['ppl'] / kv8['ppl_bf16'] - 1:+.2%}), "
          f"logits' relative error {kv8['logit_rel_err_vs_bf16']:.4f}")
    floor = process_floor()
    print(f"\nresident memory of the scheduler process, after a short generation (torch, the tokenizer and the grammar "
          f"backend alone: {floor / 1e6:.1f} MB):")
    memory = {}
    for name, cfg in cases.items():
        rss, weights, kv = resident_memory(cfg)
        memory[name] = (rss, weights, kv)
        print(f"  {name:7} {rss / 1e6:8.1f} MB resident, {(rss - weights) / 1e6:6.1f} MB besides the weights; weights "
              f"{weights / 1e6:7.1f} MB, KV pool {kv / 1e6:6.1f} MB (allocated; resident as it is used); bound 1.3 x "
              f"weights + KV pool + 300 MB = {(1.3 * weights + kv + 300e6) / 1e6:.1f} MB")

    b1, pre = "decode b=1", f"prefill {PREFILL}"

    def agree(p: dict, name: str) -> float:  # 1 - the relative perplexity difference from bf16
        return 1 - abs(p[name] / p["bf16"] - 1)

    checks = [
        ("int4 batch-1 decode >= 2x bf16", figures[(b1, "int4")] / figures[(b1, "bf16")], 2.0, "x"),
        ("int4 batch-1 decode >= 70% of its bandwidth roofline", figures[(b1, "int4", "roof")], 0.7, "%"),
        ("int4 prefill >= 0.8x bf16", figures[(pre, "int4")] / figures[(pre, "bf16")], 0.8, "x"),
        *((f"int4 (GGUF native) {what} perplexity within 3% of the dequantized path", agree(p, "int4"), 0.97, "%")
          for what, p in (("prefill", ppl), ("decode", dppl))),
        *((f"int8 {what} perplexity within 5% of bf16", agree(p, "int8"), 0.95, "%")
          for what, p in (("prefill", ppl), ("decode", dppl))),
        # 2D / (D + 2) with a bf16 scale per token and KV head: 1.94x at the bundled model's head size 64
        ("int8 KV cache holds about 2x the tokens at the same memory (>= 1.9x)", kv8["capacity_vs_bf16"], 1.9, "x"),
        *((f"{n} resident <= 1.3 x weights + KV pool + 300 MB", (1.3 * wb + kv + 300e6) / rss, 1.0, "x")
          for n, (rss, wb, kv) in memory.items()),
        *((f"{n} resident above the process floor <= 1.3 x weights + KV pool", (1.3 * wb + kv) / (rss - floor), 1.0,
           "x") for n, (rss, wb, kv) in memory.items()),
    ]
    print("\ntargets (issue 15):")
    for what, value, need, unit in checks:
        shown = f"{value:.1%}" if unit == "%" else f"{value:.2f}x"
        print(f"  {'met   ' if value >= need else 'MISSED'} {what}: {shown}")


if __name__ == "__main__":
    main()
