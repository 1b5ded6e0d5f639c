"""Model-executor speed: prefill of 1024 tokens, an extend of 64 tokens over a 1024-token cached prefix (a
multi-turn request's next turn) and decode steps at batch 1/8/32/64 over 256-token contexts, bf16 and fp32, for
radixgen's model runner beside transformers' forward on the same weights (not for the extend), beside radixgen
itself on plain torch ops, and beside the roofline from this machine's matmul peak and memory bandwidth, all
measured in this run.

    python benchmarks/bench_forward.py [--dtypes bfloat16,float32] [--batches 1,8,32,64] [--quick] [--report DIR]
"""

from __future__ import annotations

import argparse
import os
import time

# as the Engine's scheduler process does: large allocations on transparent huge pages (set before torch loads)
os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")

import torch
from report import Report, add_report_arg

from radixgen.runtime.config import RuntimeConfig
from radixgen.runtime.executor.model_runner import ForwardInput, ModelRunner
from radixgen.runtime.layers.linear import LinearBase, pack_weight, packed_linear
from radixgen.runtime.loader import resolve_model_path
from radixgen.runtime.scheduler.kv_manager import KVCacheManager

DT = {"bfloat16": torch.bfloat16, "float32": torch.float32}


def best_of(fn, reps: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times)


def measure_peaks(dtype: torch.dtype) -> tuple[float, float]:
    """(matmul FLOP/s, memory bytes/s): a large square matmul, the better of torch.matmul and oneDNN on a
    pre-packed weight (5-10% faster here, and what the engine's linear layers use), and a large copy."""
    n = 2048
    a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
    packed = pack_weight(b.t().contiguous(), n)
    t = best_of(lambda: torch.matmul(a, b), 5)
    if packed is not None:
        t = min(t, best_of(lambda: packed_linear(a, packed, None), 5))
    flops = 2 * n**3 / t
    src = torch.randn(64 * 2**20 // 4, dtype=torch.float32)  # 256 MiB, far beyond the caches
    dst = torch.empty_like(src)
    bw = 2 * src.numel() * 4 / best_of(lambda: dst.copy_(src), 5)
    return flops, bw


class OurModel:
    def __init__(self, path, dtype: str, max_batch: int, ctx: int, torch_ops: bool = False, **config) -> None:
        cfg = RuntimeConfig(model=str(path), dtype=dtype, max_total_tokens=max_batch * (ctx + 16) + 2048,
                            max_running_requests=max_batch, context_length=2048, disable_cpu_kernels=torch_ops,
                            **config)
        self.runner = ModelRunner(cfg)
        self.kv = KVCacheManager.for_runner(self.runner)  # slots and table rows, as the scheduler's manager

    def matmuls_only(self, batch: int):
        """One decode step's weight matmuls alone (every linear layer and the LM head, on their packed weights,
        nothing else), as a function to time: the floor this engine's matmul library puts under a decode step."""
        mods = [m for m in self.runner.model.modules() if isinstance(m, LinearBase)]
        xs = {n: torch.randn(batch, n, dtype=self.runner.dtype) for n in {m.in_features for m in mods}}
        return lambda: [m(xs[m.in_features]) for m in mods]

    def prefill(self, ids: list[int]) -> None:
        r = self.runner
        self.kv.allocator.reset()
        row = 0
        slots = self.kv.allocator.allocate(len(ids))
        self.kv.table.write(row, 0, slots)
        fi = ForwardInput(torch.tensor(ids), torch.arange(len(ids)), slots, torch.tensor([row]), [0], [len(ids)],
                          torch.tensor([len(ids) - 1]))
        r.forward(fi)

    def setup_extend(self, prefix: int, new: int) -> ForwardInput:
        """One request whose first `prefix` positions are in the pool (a cached prefix, random K/V) extended by `new`
        tokens: the input of a multi-turn request's next turn (run again, it rewrites the same slots)."""
        r = self.runner
        self.kv.allocator.reset()
        slots = self.kv.allocator.allocate(prefix + new)
        self.kv.table.write(0, 0, slots)
        g = torch.Generator().manual_seed(0)
        for k, v in zip(r.kv_pool.k_buffers, r.kv_pool.v_buffers, strict=True):
            k.normal_(generator=g)
            v.normal_(generator=g)
        return ForwardInput(torch.randint(0, 1000, (new,)), torch.arange(prefix, prefix + new), slots[prefix:],
                            torch.tensor([0]), [prefix], [new], torch.tensor([new - 1]))

    def setup_decode(self, batch: int, ctx: int) -> ForwardInput:
        """`batch` requests whose first `ctx` positions are in the pool; one decode step's input."""
        r = self.runner
        self.kv.allocator.reset()
        for row in range(batch):
            self.kv.table.write(row, 0, self.kv.allocator.allocate(ctx + 1))
        g = torch.Generator().manual_seed(0)
        for k, v in zip(r.kv_pool.k_buffers, r.kv_pool.v_buffers, strict=True):
            k.normal_(generator=g)
            v.normal_(generator=g)
        rows = torch.arange(batch)
        return ForwardInput(torch.randint(0, 1000, (batch,)), torch.full((batch,), ctx),
                            r.req_to_slot[rows, ctx], rows, [ctx] * batch, [1] * batch, torch.arange(batch))


class HFModel:
    def __init__(self, path, dtype: str) -> None:
        import transformers as tf

        self.model = tf.AutoModelForCausalLM.from_pretrained(path, dtype=DT[dtype]).eval()

    @torch.inference_mode()
    def prefill(self, ids: list[int]) -> None:
        self.model(torch.tensor([ids]), use_cache=True, logits_to_keep=1)

    @torch.inference_mode()
    def setup_decode(self, batch: int, ctx: int):
        ids = torch.randint(0, 1000, (batch, ctx))
        out = self.model(ids, use_cache=True, logits_to_keep=1)
        return out.past_key_values

    @torch.inference_mode()
    def decode(self, cache, batch: int, ctx: int) -> None:
        # one step, then drop the appended position so every timed step sees the same context
        self.model(torch.randint(0, 1000, (batch, 1)), past_key_values=cache, use_cache=True,
                   cache_position=torch.tensor([ctx]))
        cache.crop(-1)


def model_costs(runner: ModelRunner, dtype: torch.dtype):
    mc = runner.model_config
    esize = torch.empty((), dtype=dtype).element_size()
    # every linear layer and the LM head (which, tied, is the embedding's table too)
    matmul_params = sum(m.in_features * m.out_features for m in runner.model.modules() if isinstance(m, LinearBase))
    kv_per_token = 2 * mc.num_layers * mc.num_kv_heads * mc.head_dim * esize
    attn_flops_per_pair = 4 * mc.num_layers * mc.num_heads * mc.head_dim  # QK^T and PV, per (query, key)
    return matmul_params, matmul_params * esize, kv_per_token, attn_flops_per_pair


def roofline_tps(tokens: int, flops: float, nbytes: float, ceil: dict) -> tuple[float, str]:
    t_compute, t_memory = flops / ceil["peak"], nbytes / ceil["bw"]
    return tokens / max(t_compute, t_memory), ("bandwidth" if t_memory > t_compute else "compute")


def windows(fns: dict, reps: int, n_windows: int, dtype: str, tokens: int, flops: float, nbytes: float) -> dict:
    """Times the engines in `fns` (name -> one run) in `n_windows` windows, each between two measurements of
    the ceilings; inside a window the engines take turns, one run each, `reps` rounds, so that every engine
    meets the same machine. This machine's memory bandwidth swings between about 35 and 75 GB/s within a minute
    with its neighbours' load: a ceiling measured far from a timing, or a baseline timed a minute later, can
    belong to another regime. Returns each engine's best time over all windows, and per window radixgen's
    ("ours") best time set against the better of the window's two ceilings, the median window apart."""
    for fn in fns.values():
        fn()  # warm-up
    best = {name: float("inf") for name in fns}
    rows = []
    for _ in range(n_windows):
        before = measure_peaks(DT[dtype])
        t_win = {name: float("inf") for name in fns}
        for _ in range(reps):
            for name, fn in fns.items():
                t0 = time.perf_counter()
                fn()
                t_win[name] = min(t_win[name], time.perf_counter() - t0)
        after = measure_peaks(DT[dtype])
        for name in fns:
            best[name] = min(best[name], t_win[name])
        ceil = {"peak": max(before[0], after[0]), "bw": max(before[1], after[1])}
        roof, bound = roofline_tps(tokens, flops, nbytes, ceil)
        rows.append({"t": t_win["ours"], "ceil": ceil, "roof": roof, "bound": bound,
                     "frac": tokens / t_win["ours"] / roof})
    rows.sort(key=lambda r: r["frac"])
    return {"best": best, "median": rows[len(rows) // 2], "windows": rows}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dtypes", default="bfloat16,float32")
    ap.add_argument("--batches", default="1,8,32,64")
    ap.add_argument("--prefill", type=int, default=1024)
    ap.add_argument("--ctx", type=int, default=256)
    ap.add_argument("--extend", default="64/1024",
                    help="NEW/PREFIX: a prefill of NEW tokens over PREFIX cached ones (a multi-turn request's next "
                         "turn; transformers not timed); empty: none")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--windows", type=int, default=3, help="measurement windows per case (see `windows`)")
    ap.add_argument("--quick", action="store_true", help="fewer repetitions, one window")
    ap.add_argument("--no-torch-ops", action="store_true",
                    help="skip the column of radixgen with its C kernels and packed weights turned off")
    add_report_arg(ap)
    args = ap.parse_args()
    report = Report(args.report, "bench_forward", "Model executor: decode tok/s by batch") if args.report else None
    reps = 2 if args.quick else args.reps
    n_windows = 1 if args.quick else args.windows
    path = resolve_model_path(None)
    batches = [int(b) for b in args.batches.split(",")]
    print(f"model: {path.name}, torch threads: {torch.get_num_threads()}")
    rows = []
    for dtype in args.dtypes.split(","):
        ours, hf = OurModel(path, dtype, max(batches), args.ctx), HFModel(path, dtype)
        plain = None if args.no_torch_ops else OurModel(path, dtype, max(batches), args.ctx, torch_ops=True)
        params, wbytes, kv_tok, attn_pair = model_costs(ours.runner, DT[dtype])
        ids = torch.randint(0, 1000, (args.prefill,)).tolist()
        n = args.prefill
        # every engine here turns only the last position into logits: the LM head runs on one row
        head = ours.runner.model_config.vocab_size * ours.runner.model_config.hidden_size
        prefill_flops = 2 * (params - head) * n + 2 * head + attn_pair * n * n / 2
        fns = {"ours": lambda ours=ours, ids=ids: ours.prefill(ids), "hf": lambda hf=hf, ids=ids: hf.prefill(ids)}
        if plain:
            fns["plain"] = lambda plain=plain, ids=ids: plain.prefill(ids)
        w = windows(fns, reps, n_windows, dtype, n, prefill_flops, 0)
        # (dtype, case, ours, torch ops, transformers tok/s, windows)
        rows.append((dtype, f"prefill {n}", n / w["best"]["ours"], n / w["best"].get("plain", float("nan")),
                     n / w["best"]["hf"], w))
        if args.extend:
            new, prefix = (int(v) for v in args.extend.split("/"))
            fi = ours.setup_extend(prefix, new)
            fns = {"ours": lambda fi=fi, ours=ours: ours.runner.forward(fi)}
            if plain:
                pfi = plain.setup_extend(prefix, new)
                fns["plain"] = lambda pfi=pfi, plain=plain: plain.runner.forward(pfi)
            flops = 2 * (params - head) * new + 2 * head + attn_pair * new * (prefix + new / 2)
            w = windows(fns, reps * 2, n_windows, dtype, new, flops, wbytes + kv_tok * (prefix + new))
            rows.append((dtype, f"extend {new}/{prefix}", new / w["best"]["ours"],
                         new / w["best"].get("plain", float("nan")), float("nan"), w))
        for b in batches:
            fi = ours.setup_decode(b, args.ctx)
            flops = 2 * params * b + attn_pair * b * args.ctx
            nbytes = wbytes + kv_tok * b * args.ctx
            cache = hf.setup_decode(b, args.ctx)
            fns = {"ours": lambda fi=fi, ours=ours: ours.runner.forward(fi),
                   "hf": lambda cache=cache, b=b, hf=hf: hf.decode(cache, b, args.ctx)}
            if plain:
                pfi = plain.setup_decode(b, args.ctx)
                fns["plain"] = lambda pfi=pfi, plain=plain: plain.runner.forward(pfi)
            w = windows(fns, reps * 2, n_windows, dtype, b, flops, nbytes)
            rows.append((dtype, f"decode b={b}", b / w["best"]["ours"], b / w["best"].get("plain", float("nan")),
                         b / w["best"]["hf"], w))
            if b == 1:
                wm = windows({"ours": ours.matmuls_only(1)}, reps, n_windows, dtype, 1, flops, nbytes)
                rows.append((dtype, "  matmuls only", 1 / wm["best"]["ours"], float("nan"), float("nan"), wm))
        ours = hf = plain = None  # free the models before the next dtype
    print("\nper measurement window: share of its roofline (ceilings measured right before and after it)")
    for dtype, case, *_, w in rows:
        print(f"  [{dtype}] {case.strip():14} " + "  ".join(
            f"{r['frac']:6.1%} ({r['ceil']['peak'] / 1e12:.3f} TFLOP/s, {r['ceil']['bw'] / 1e9:4.1f} GB/s)"
            for r in sorted(w["windows"], key=lambda r: r["frac"])))
    print(f"\n{'dtype':9} {'case':14} {'radixgen tok/s':>15} {'torch ops':>10} {'transformers':>13} {'vs hf':>7} "
          f"{'roofline tok/s':>15} {'of roofline':>12}")
    for dtype, case, ours_tps, plain_tps, hf_tps, w in rows:
        med = w["median"]
        print(f"{dtype:9} {case:14} {ours_tps:15.1f} {plain_tps:10.1f} {hf_tps:13.1f} {ours_tps / hf_tps:6.2f}x "
              f"{med['roof']:15.1f} {med['frac']:11.1%} ({med['bound']}-bound)")
    print("\ntorch ops: radixgen with its C kernels and oneDNN-packed weights turned off (disable_cpu_kernels);\n"
          "matmuls only: a batch-1 step's weight matmuls alone through oneDNN (linear layers + LM head), the\n"
          "floor of an engine that calls the matmul library once per layer (the fused CPU decode step streams\n"
          "the layers' weights with its own kernel). The engines take turns inside each measurement window; tok/s:\n"
          "each engine's best over all windows; roofline and of roofline: radixgen's median window, its time\n"
          "against the ceilings measured right before and after that window.")
    if report is not None:
        write_report(report, rows, args)


def write_report(report: Report, rows: list[tuple], args) -> None:
    report.text(f"Decode steps over {args.ctx}-token contexts on the default model: radixgen's model runner beside "
                "transformers' forward on the same weights and beside radixgen on plain torch ops (its C kernels "
                "and packed weights off), each engine's best over the measurement windows, and the roofline from "
                "this machine's matmul peak and memory bandwidth measured in the same run (dashed).")
    for dtype in dict.fromkeys(r[0] for r in rows):
        decode = [r for r in rows if r[0] == dtype and r[1].startswith("decode b=")]
        batches = [int(r[1].split("=")[1]) for r in decode]
        series = {"radixgen": [r[2] for r in decode], "radixgen, torch ops": [r[3] for r in decode],
                  "transformers": [r[4] for r in decode], "roofline": [r[5]["median"]["roof"] for r in decode]}
        if all(v != v for v in series["radixgen, torch ops"]):  # --no-torch-ops: all NaN
            del series["radixgen, torch ops"]
        report.lines(f"decode-{dtype}", f"Decode tok/s by batch ({dtype})", batches, series, xlabel="batch",
                     ylabel="output tokens / s", log_x=True, log_y=True, dashed=["roofline"])
    report.table(["dtype", "case", "radixgen tok/s", "torch ops", "transformers", "roofline tok/s", "of roofline"],
                 [[d, c.strip(), f"{o:.1f}", f"{p:.1f}", f"{h:.1f}", f"{w['median']['roof']:.1f}",
                   f"{w['median']['frac']:.1%}"] for d, c, o, p, h, w in rows])
    report.write()


if __name__ == "__main__":
    main()
