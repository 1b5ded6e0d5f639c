"""Which waiting-queue order serves a cache best: fcfs, lpm (longest prefix match) or dfs-weight.

Workload: requests over 8 distinct ~400-token prefixes arrive interleaved (prefix 0, 1, ..., 7, 0, 1,
...), more than fit in one batch (max_running_requests=8) and in a KV pool too small to keep every
prefix cached, so the order decides how often a prefix is recomputed after being evicted. Prints
requests/s and the cache hit rate per policy, measured in one run with the default model in bf16.

    python benchmarks/bench_schedule_policy.py [--quick]
"""

from __future__ import annotations

import argparse
import random
import time

from radixgen.runtime.engine import Engine
from radixgen.runtime.loader import load_tokenizer


def workload(tok, n_prefixes: int, per_prefix: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    words = "alpha beta gamma delta river stone cloud maple orbit signal copper lantern meadow".split()
    prefixes = [tok(f"Document {p}: " + " ".join(rng.choice(words) for _ in range(380))).input_ids
                for p in range(n_prefixes)]
    return [prefixes[i % n_prefixes] + tok(f" Question {i}: what is word {i}?").input_ids
            for i in range(n_prefixes * per_prefix)]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    tok = load_tokenizer(None)
    prompts = workload(tok, 8, 3 if args.quick else 6)
    sp = {"max_new_tokens": 8, "temperature": 0.0, "ignore_eos": True}
    # the pool holds the running batch plus about 3 of the 8 prefixes
    pool = 8 * (len(prompts[0]) + 16) + 3 * len(prompts[0])
    print(f"{len(prompts)} requests over 8 prefixes of ~{len(prompts[0])} tokens; KV pool {pool} tokens")
    print(f"{'policy':11} {'req/s':>8} {'hit rate':>9}")
    for policy in ("fcfs", "lpm", "dfs-weight"):
        with Engine(dtype="bfloat16", schedule_policy=policy, max_running_requests=8,
                    max_total_tokens=pool) as eng:
            eng.generate("warm up", {"max_new_tokens": 1})
            before = eng.get_server_info()["stats"]
            t = time.perf_counter()
            eng.generate(input_ids=prompts, sampling_params=sp)
            dt = time.perf_counter() - t
            stats = eng.get_server_info()["stats"]
            cached = stats["cached_tokens"] - before["cached_tokens"]
            hit = cached / (stats["prompt_tokens"] - before["prompt_tokens"])
            print(f"{policy:11} {len(prompts) / dt:8.2f} {hit:9.1%}", flush=True)


if __name__ == "__main__":
    main()
