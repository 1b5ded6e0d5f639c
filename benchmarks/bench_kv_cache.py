"""The 8-bit KV cache (kv_cache_dtype int8, fp8_e4m3) against the bf16 cache, on the default model, in one run
with the engines taking turns (A, B, A, B ...): decode steps at batch 1 and 8 over several context lengths,
prefill of 1024 tokens, the pool's capacity in tokens at the same memory, and the logit error and perplexity on a
fixed text (benchmarks/data/kv_text.txt, written for this benchmark) against the bf16 cache.

    python benchmarks/bench_kv_cache.py [--quick] [--kv int8,fp8_e4m3] [--contexts 256,1024,4096] [--batches 1,8]

`kv_cache_row(kv_cache_dtype, quick)` is the same measurement as one row (a dict) for benchmarks/bench_quant.py.
Decode contexts are filled with random codes (attention's cost does not depend on the values); the accuracy
figures come from a real prefill of the text, whose later tokens read the earlier ones' codes from the pool.
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import time
from pathlib import Path

os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")  # as the scheduler process does (set before torch loads)

import torch

from radixgen.runtime.config import RuntimeConfig
from radixgen.runtime.executor.model_runner import ForwardInput, ModelRunner
from radixgen.runtime.ground.kv_pool import KVPool
from radixgen.runtime.loader import load_tokenizer
from radixgen.runtime.scheduler.kv_manager import KVCacheManager

TEXT = Path(__file__).parent / "data" / "kv_text.txt"
BASELINE = "auto"  # the bf16 cache (the model dtype)


class Engine:
    """A model runner with the given KV cache dtype, and its slots and table rows."""

    def __init__(self, kv_cache_dtype: str, slots: int, max_batch: int) -> None:
        cfg = RuntimeConfig(dtype="bfloat16", kv_cache_dtype=kv_cache_dtype, max_total_tokens=slots,
                            max_running_requests=max_batch, context_length=8192)
        self.name = kv_cache_dtype
        self.runner = ModelRunner(cfg)
        self.kv = KVCacheManager.for_runner(self.runner)

    def prefill(self, ids: list[int], chunk: int | None = None) -> torch.Tensor:
        """The float32 logits of every position of `ids` (one request), prefilled in chunks of `chunk` tokens."""
        self.kv.allocator.reset()
        chunk = chunk or len(ids)
        out = []
        for start in range(0, len(ids), chunk):
            part = ids[start:start + chunk]
            slots = self.kv.allocator.allocate(len(part))
            self.kv.table.write(0, start, slots)
            out.append(self.runner.forward(ForwardInput(
                torch.tensor(part), torch.arange(start, start + len(part)), slots, torch.tensor([0]), [start],
                [len(part)], torch.arange(len(part)))))
        return torch.cat(out)

    def setup_decode(self, batch: int, ctx: int) -> ForwardInput:
        """`batch` requests with `ctx` positions each in the pool (random values or codes); one decode step."""
        self.kv.allocator.reset()
        for row in range(batch):
            self.kv.table.write(row, 0, self.kv.allocator.allocate(ctx + 1))
        g = torch.Generator().manual_seed(0)
        pool = self.runner.kv_pool
        for i in range(len(pool.k_buffers)):
            for t in pool.layer(i):
                if t is None:
                    continue
                if t.dtype == torch.int8:
                    t.copy_(torch.randint(-127, 128, t.shape, generator=g, dtype=torch.int8))
                elif t.dtype == torch.float8_e4m3fn:
                    t.copy_(torch.randn(t.shape, generator=g).mul_(64).to(t.dtype))
                elif pool.quantized:  # scales
                    t.copy_(torch.rand(t.shape, generator=g).mul_(0.02).to(t.dtype))
                else:
                    t.normal_(generator=g)
        rows = torch.arange(batch)
        table = self.runner.req_to_slot
        return ForwardInput(torch.randint(0, 1000, (batch,)), torch.full((batch,), ctx), table[rows, ctx], rows,
                            [ctx] * batch, [1] * batch, torch.arange(batch))


def take_turns(engines: list[Engine], fns: dict[str, callable], reps: int) -> dict[str, list[float]]:
    """Seconds of each engine's run, `reps` rounds, one run each per round (after a warm-up round)."""
    times = {e.name: [] for e in engines}
    for rnd in range(reps + 1):
        for e in engines:
            t = time.perf_counter()
            fns[e.name]()
            if rnd:
                times[e.name].append(time.perf_counter() - t)
    return times


def capacity_at(memory_gb: float, kv_cache_dtype: str, mc) -> int:
    code = RuntimeConfig(kv_cache_dtype=kv_cache_dtype).kv_code_dtype
    per_slot = KVPool.bytes_per_slot(mc.num_layers, mc.num_kv_heads, mc.head_dim, torch.bfloat16, code)
    return int(memory_gb * 2**30) // per_slot


def accuracy(engines: list[Engine], ids: list[int], chunk: int) -> dict[str, dict]:
    """Perplexity of the text and the logits' relative L2 error against the bf16 cache's, per engine."""
    logits = {e.name: e.prefill(ids, chunk) for e in engines}
    target = torch.tensor(ids[1:])
    out = {}
    for name, lg in logits.items():
        nll = torch.nn.functional.cross_entropy(lg[:-1], target).item()
        ref = logits[BASELINE]
        out[name] = {"ppl": math.exp(nll), "logit_rel_err": ((lg - ref).norm() / ref.norm()).item(),
                     "argmax_agree": (lg.argmax(-1) == ref.argmax(-1)).float().mean().item()}
    return out


def measure(kv_dtypes: list[str], contexts: list[int], batches: list[int], reps: int, prefill_len: int,
            text_tokens: int) -> dict:
    """Every figure of this benchmark for the bf16 cache and each of kv_dtypes, in one run."""
    torch.manual_seed(0)
    max_batch = max(batches)
    slots = max(max_batch * (max(contexts) + 2), prefill_len, text_tokens) + 16
    engines = [Engine(kv, slots, max_batch) for kv in [BASELINE, *kv_dtypes]]
    mc = engines[0].runner.model_config
    res: dict = {"decode": {}, "prefill": {}, "capacity_2gb": {}, "accuracy": {}}
    for b in batches:
        for ctx in contexts:
            inputs = {e.name: e.setup_decode(b, ctx) for e in engines}
            fns = {e.name: (lambda e=e, fi=inputs[e.name]: e.runner.forward(fi)) for e in engines}
            t = take_turns(engines, fns, reps)
            res["decode"][(b, ctx)] = {n: (min(v), statistics.median(v)) for n, v in t.items()}
    ids = torch.randint(3, 49152, (prefill_len,), generator=torch.Generator().manual_seed(1)).tolist()
    t = take_turns(engines, {e.name: (lambda e=e: e.prefill(ids)) for e in engines}, reps)
    res["prefill"] = {n: (min(v), statistics.median(v)) for n, v in t.items()}
    res["capacity_2gb"] = {e.name: capacity_at(2.0, e.name, mc) for e in engines}
    text = load_tokenizer(None)(TEXT.read_text())["input_ids"][:text_tokens]
    res["accuracy"] = accuracy(engines, text, chunk=128)
    res["text_tokens"] = len(text)
    return res


def kv_cache_row(kv_cache_dtype: str = "int8", quick: bool = False) -> dict:
    """One row for benchmarks/bench_quant.py: this cache against the bf16 cache, measured in one run."""
    contexts = [256, 1024] if quick else [256, 1024, 4096]
    res = measure([kv_cache_dtype], contexts, [1, 8], 2 if quick else 7, 1024, 512 if quick else 1024)
    row = {"kv_cache_dtype": kv_cache_dtype}
    for (b, ctx), t in res["decode"].items():
        row[f"decode_b{b}_ctx{ctx}_tok_s"] = b / t[kv_cache_dtype][0]
        row[f"decode_b{b}_ctx{ctx}_vs_bf16"] = t[BASELINE][0] / t[kv_cache_dtype][0]
    row["prefill_1024_tok_s"] = 1024 / res["prefill"][kv_cache_dtype][0]
    row["prefill_1024_vs_bf16"] = res["prefill"][BASELINE][0] / res["prefill"][kv_cache_dtype][0]
    row["capacity_tokens_2gb"] = res["capacity_2gb"][kv_cache_dtype]
    row["capacity_vs_bf16"] = res["capacity_2gb"][kv_cache_dtype] / res["capacity_2gb"][BASELINE]
    acc = res["accuracy"]
    row["ppl"], row["ppl_bf16"] = acc[kv_cache_dtype]["ppl"], acc[BASELINE]["ppl"]
    row["logit_rel_err_vs_bf16"] = acc[kv_cache_dtype]["logit_rel_err"]
    return row


def report(res: dict, kv_dtypes: list[str]) -> None:
    names = [BASELINE, *kv_dtypes]
    label = {BASELINE: "bf16 cache", "int8": "int8 cache", "fp8_e4m3": "fp8 e4m3 cache"}

    def row(title: str, cells: list[str]) -> None:
        print(f"{title:<22}" + "".join(f"{c:>32}" for c in cells))

    print(f"threads {torch.get_num_threads()}; decode and prefill: best of the turns (median in ms), x = bf16 time / "
          f"this time")
    row("", [label[n] for n in names])
    for (b, ctx), t in res["decode"].items():
        base = t[BASELINE][0]
        row(f"decode b{b} ctx {ctx}", [f"{b / t[n][0]:7.1f} tok/s {t[n][1] * 1e3:6.1f} ms x{base / t[n][0]:4.2f}"
                                     for n in names])
    pre = res["prefill"]
    row("prefill 1024", [f"{1024 / pre[n][0]:7.0f} tok/s {pre[n][1] * 1e3:6.0f} ms x{pre[BASELINE][0] / pre[n][0]:4.2f}"
                         for n in names])
    cap = res["capacity_2gb"]
    row("capacity at 2 GiB", [f"{cap[n]} tokens x{cap[n] / cap[BASELINE]:4.2f}" for n in names])
    acc = res["accuracy"]
    row(f"text, {res['text_tokens']} tokens", [f"ppl {acc[n]['ppl']:.3f}, logit err {acc[n]['logit_rel_err']:.4f}"
                                              for n in names])
    row("  argmax = bf16's", [f"{acc[n]['argmax_agree']:.3f}" for n in names])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--kv", default="int8,fp8_e4m3", help="8-bit cache dtypes beside the bf16 cache")
    ap.add_argument("--contexts", default="256,1024,4096")
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--quick", action="store_true", help="int8 only, contexts 256 and 1024, 2 turns, 512 text tokens")
    args = ap.parse_args()
    kv = ["int8"] if args.quick else args.kv.split(",")
    contexts = [256, 1024] if args.quick else [int(c) for c in args.contexts.split(",")]
    res = measure(kv, contexts, [int(b) for b in args.batches.split(",")], 2 if args.quick else args.reps, 1024,
                  512 if args.quick else 1024)
    report(res, kv)


if __name__ == "__main__":
    main()
