"""Prefix-cache payoff on three generated workloads, with the default model in bf16:

  few-shot     a ~1,000-token shared few-shot prefix + 64 questions
  multi-turn   16 chat sessions x 4 turns (each turn's prompt = the whole conversation so far)
  branching    8 roots x 8 branches (tree-of-thought: a root thought, then 8 continuations of it)

For each: radixgen with the radix cache on, radixgen with it off, and transformers `generate` run
request by request (on a subset, as it is slow; its per-request figures are what it measured), in one
run. Prints requests/s, output tokens/s, the cache hit rate and the best hit rate the workload allows.

    python benchmarks/bench_prefix_cache.py [--quick] [--hf-requests 6] [--report DIR]
"""

from __future__ import annotations

import argparse
import random
import time

import torch
from report import Report, add_report_arg

from radixgen.runtime.engine import Engine
from radixgen.runtime.loader import load_tokenizer, resolve_model_path

WORDS = ("river stone market winter lantern orbit copper meadow signal harbor velvet engine "
         "garden thunder pocket silver island canvas mirror forest ladder rocket planet violin").split()


def sentence(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n)).capitalize() + "."


class Workload:
    """Waves of requests; a wave's prompts may depend on the previous wave's outputs."""

    def __init__(self, name: str, tok, max_new: int) -> None:
        self.name, self.tok, self.max_new = name, tok, max_new

    def ids(self, text: str) -> list[int]:
        return self.tok(text).input_ids

    def turn(self, role: str, text: str) -> list[int]:
        return self.ids(f"<|im_start|>{role}\n{text}<|im_end|>\n")


def few_shot(tok, n_questions: int, max_new: int, rng: random.Random):
    w = Workload("few-shot", tok, max_new)
    shots = []
    while len(w.ids("".join(shots))) < 1000:
        shots.append(f"Question: What comes after the {rng.choice(WORDS)} in the {rng.choice(WORDS)}? "
                     f"Answer: {sentence(rng, 12)}\n")
    prefix = w.ids("".join(shots))
    questions = [prefix + w.ids(f"Question: What comes after the {rng.choice(WORDS)} {i}? Answer:")
                 for i in range(n_questions)]

    def waves(run):
        run(questions)

    return w, waves


def multi_turn(tok, sessions: int, turns: int, max_new: int, rng: random.Random):
    w = Workload("multi-turn", tok, max_new)
    system = w.turn("system", "You are a helpful assistant. " + " ".join(sentence(rng, 14) for _ in range(16)))

    def waves(run):
        convs = [system for _ in range(sessions)]
        for t in range(turns):
            prompts = [c + w.turn("user", f"Session {s} turn {t}: {sentence(rng, 24)}") + w.ids(
                "<|im_start|>assistant\n") for s, c in enumerate(convs)]
            outs = run(prompts)
            convs = [p + o + w.ids("<|im_end|>\n") for p, o in zip(prompts, outs, strict=True)]

    return w, waves


def branching(tok, roots: int, branches: int, max_new: int, rng: random.Random):
    w = Workload("branching", tok, max_new)

    def waves(run):
        heads = [w.turn("user", f"Problem {r}: " + " ".join(sentence(rng, 16) for _ in range(10)))
                 + w.ids("<|im_start|>assistant\nLet me think.") for r in range(roots)]
        thoughts = run(heads)
        run([h + t + w.ids(f" Option {b}: try {rng.choice(WORDS)} first.") for h, t in
             zip(heads, thoughts, strict=True) for b in range(branches)])

    return w, waves


def best_hit_tokens(history: list[list[int]], prompt: list[int]) -> int:
    """Tokens of `prompt` an ideal (unbounded) cache could serve: its longest common prefix with any
    earlier sequence, keeping one token to compute."""
    best = 0
    for h in history:
        n = min(len(h), len(prompt) - 1)
        i = 0
        while i < n and h[i] == prompt[i]:
            i += 1
        best = max(best, i)
    return best


def run_engine(eng: Engine, make, max_new: int) -> dict:
    workload, waves = make()
    sp = {"max_new_tokens": max_new, "temperature": 0.0, "ignore_eos": True}
    stats = {"requests": 0, "out_tokens": 0, "prompt": 0, "cached": 0, "ideal": 0}
    history: list[list[int]] = []

    def run(prompts):
        res = eng.generate(input_ids=prompts, sampling_params=sp)
        res = res if isinstance(res, list) else [res]
        for p, r in zip(prompts, res, strict=True):
            stats["requests"] += 1
            stats["out_tokens"] += r["meta_info"]["completion_tokens"]
            stats["prompt"] += len(p)
            stats["cached"] += r["meta_info"]["cached_tokens"]
        for p in prompts:  # same-wave siblings share what an earlier one computed
            stats["ideal"] += best_hit_tokens(history, p)
            history.append(p)
        for p, r in zip(prompts, res, strict=True):
            history.append(p + r["output_ids"])
        return [r["output_ids"] for r in res]

    eng.flush_cache()
    t = time.perf_counter()
    waves(run)
    stats["seconds"] = time.perf_counter() - t
    return stats


def run_transformers(model, make, max_new: int, limit: int) -> dict:
    workload, waves = make()
    stats = {"requests": 0, "out_tokens": 0, "seconds": 0.0}

    def run(prompts):
        outs = []
        for p in prompts:
            if stats["requests"] >= limit:
                outs.append([])
                continue
            t = time.perf_counter()
            with torch.no_grad():
                out = model.generate(torch.tensor([p]), max_new_tokens=max_new, min_new_tokens=max_new,
                                     do_sample=False, pad_token_id=0)
            stats["seconds"] += time.perf_counter() - t
            stats["requests"] += 1
            stats["out_tokens"] += out.shape[1] - len(p)
            outs.append(out[0, len(p):].tolist())
        return outs

    waves(run)
    return stats


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="smaller workloads")
    ap.add_argument("--hf-requests", type=int, default=6, help="requests per workload for transformers")
    ap.add_argument("--max-new", type=int, default=16)
    add_report_arg(ap)
    args = ap.parse_args()
    report = Report(args.report, "bench_prefix_cache", "Prefix cache: speed-up by workload") if args.report else None
    tok = load_tokenizer(None)
    q = args.quick
    makers = {
        "few-shot": lambda: few_shot(tok, 16 if q else 64, args.max_new, random.Random(1)),
        "multi-turn": lambda: multi_turn(tok, 4 if q else 16, 4, args.max_new, random.Random(2)),
        "branching": lambda: branching(tok, 2 if q else 8, 8, args.max_new, random.Random(3)),
    }
    results: dict[tuple[str, str], dict] = {}
    for label, kw in (("cache on", {}), ("cache off", {"disable_radix_cache": True})):
        with Engine(dtype="bfloat16", max_running_requests=64, **kw) as eng:
            eng.generate("warm up", {"max_new_tokens": 2})
            for name, make in makers.items():
                results[(name, label)] = run_engine(eng, make, args.max_new)
                r = results[(name, label)]
                print(f"{name:11} {label:10} {r['requests'] / r['seconds']:7.2f} req/s  "
                      f"hit {r['cached'] / r['prompt']:.1%}", flush=True)
    import transformers as tf

    model = tf.AutoModelForCausalLM.from_pretrained(resolve_model_path(None), dtype=torch.bfloat16).eval()
    for name, make in makers.items():
        results[(name, "transformers")] = run_transformers(model, make, args.max_new, args.hf_requests)

    print(f"\n{'workload':11} {'system':13} {'req/s':>8} {'out tok/s':>10} {'hit rate':>9} {'best hit':>9} "
          f"{'speed-up vs cache off':>22}")
    for name in makers:
        off = results[(name, "cache off")]
        for label in ("cache on", "cache off", "transformers"):
            r = results[(name, label)]
            rps, tps = r["requests"] / r["seconds"], r["out_tokens"] / r["seconds"]
            hit = f"{r['cached'] / r['prompt']:.1%}" if "cached" in r else "-"
            best = f"{r['ideal'] / r['prompt']:.1%}" if "ideal" in r else "-"
            speed = rps / (off["requests"] / off["seconds"])
            note = f" ({r['requests']} requests)" if label == "transformers" else ""
            print(f"{name:11} {label:13} {rps:8.2f} {tps:10.1f} {hit:>9} {best:>9} {speed:21.2f}x{note}")
    if report is not None:
        write_report(report, results, list(makers), args)


def write_report(report: Report, results: dict[tuple[str, str], dict], names: list[str], args) -> None:
    def rps(name: str, label: str) -> float:
        r = results[(name, label)]
        return r["requests"] / r["seconds"]

    report.text(f"The default model in bf16, {'quick' if args.quick else 'full'} workloads, max_new_tokens "
                f"{args.max_new}: radixgen with its radix cache on and off, and transformers `generate` request by "
                f"request ({args.hf_requests} requests per workload), all in one run. Speed-up: requests/s against "
                "radixgen with the cache off (the dashed line).")
    report.bars("speedup", "Requests/s against radixgen with the cache off", names,
                {label: [rps(n, label) / rps(n, "cache off") for n in names] for label in ("cache on", "transformers")},
                ylabel="speed-up (x)", baseline=1.0)
    report.bars("hit-rate", "Cache hit rate: measured and the best the workload allows", names,
                {"measured": [results[(n, "cache on")]["cached"] / results[(n, "cache on")]["prompt"] for n in names],
                 "best possible": [results[(n, "cache on")]["ideal"] / results[(n, "cache on")]["prompt"]
                                   for n in names]},
                ylabel="share of prompt tokens", value_format="{:.0%}")
    report.table(["workload", "system", "req/s", "out tok/s", "speed-up vs cache off"],
                 [[n, label, f"{rps(n, label):.2f}",
                   f"{results[(n, label)]['out_tokens'] / results[(n, label)]['seconds']:.1f}",
                   f"{rps(n, label) / rps(n, 'cache off'):.2f}x"]
                  for n in names for label in ("cache on", "cache off", "transformers")])
    report.write()


if __name__ == "__main__":
    main()
