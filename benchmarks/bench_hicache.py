"""The hierarchical cache's payoff, in one run, with the default model (SmolLM2-135M-Instruct) unless --model says
otherwise:

  agent        sessions of an agent over one long system prompt and tool list, turn after turn (each turn's prompt
               is the whole conversation so far), all sessions in flight each turn: a working set of at least 4x
               the KV pool. Today's LRU tree recomputes every evicted conversation; the hierarchical cache loads it
               back from its host tier. Prints requests/s and the median time to first token of both.
  restart      a 2k-token shared prefix served by a server that is then shut down; a new server over the same
               --kv-cache-dir (warm disk tier) against one over an empty folder (cold): the first request's time
               to first token.

    python benchmarks/bench_hicache.py [--quick] [--model PATH] [--report DIR]
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import tempfile
import time

from report import Report, add_report_arg

from radixgen.runtime.engine import Engine
from radixgen.runtime.loader import load_tokenizer

WORDS = ("search fetch parse summarize file query table column schema index cache request response token error "
         "retry timeout limit budget plan step tool call result value string number list object field").split()
PAGE = 16  # the disk tier writes whole pages; the same page size for every system compared


def text(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


def agent_prefix(tok, rng: random.Random, tokens: int) -> list[int]:
    tools = []
    while len(tok("".join(tools)).input_ids) < tokens:
        i = len(tools)
        tools.append(f"Tool {i}: name tool_{i}; does {text(rng, 12)}; arguments {{{text(rng, 6)}}}.\n")
    return tok("You are an agent. Use the tools below.\n" + "".join(tools)).input_ids


async def first_token(eng: Engine, ids: list[int], max_new: int) -> tuple[float, list[int]]:
    """Time to first token (the first streamed chunk) and the output ids."""
    t = time.perf_counter()
    ttft, out = None, []
    stream = await eng.async_generate(input_ids=ids, stream=True, sampling_params={
        "max_new_tokens": max_new, "temperature": 0.0, "ignore_eos": True})
    async for chunk in stream:
        if ttft is None:
            ttft = time.perf_counter() - t
        out = chunk["output_ids"]
    return ttft, out


def run_agent(eng: Engine, tok, sessions: int, turns: int, system: int, obs: int, max_new: int) -> dict:
    rng = random.Random(7)
    prefix = agent_prefix(tok, rng, system)
    convs = [prefix + tok(f"Task {s}: {text(rng, obs)}\n").input_ids for s in range(sessions)]
    ttfts: list[float] = []
    t0 = time.perf_counter()

    async def turn(t: int) -> None:
        prompts = [c + tok(f"Observation {t}: {text(rng, obs)}\nNext step:").input_ids for c in convs]
        results = await asyncio.gather(*(first_token(eng, p, max_new) for p in prompts))
        for s, (ttft, out) in enumerate(results):
            ttfts.append(ttft)
            convs[s] = prompts[s] + out

    for t in range(turns):
        asyncio.run(turn(t))
    seconds = time.perf_counter() - t0
    info = eng.get_server_info()
    return {"requests": sessions * turns, "seconds": seconds, "median_ttft": statistics.median(ttfts),
            "working_set": len(prefix) + sum(len(c) - len(prefix) for c in convs),
            "hit_rate": info["cache_hit_rate"], "hicache": info.get("hicache")}


def restart_ttft(model, tok, kv_dir: str, prefix: list[int], question: str, common: dict) -> float:
    with Engine(model, kv_cache_dir=kv_dir, **common) as eng:
        asyncio.run(first_token(eng, tok("warm up the kernels").input_ids, 2))
        ttft, _ = asyncio.run(first_token(eng, prefix + tok(question).input_ids, 4))
    return ttft


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="fewer sessions and a shorter restart prefix")
    ap.add_argument("--model", default=None, help="default: the bundled SmolLM2-135M-Instruct")
    ap.add_argument("--max-new", type=int, default=4)
    add_report_arg(ap)
    args = ap.parse_args()
    tok = load_tokenizer(args.model)
    sessions, turns, system, obs = (10, 3, 160, 96) if args.quick else (24, 4, 256, 160)
    # the pool holds about one whole conversation at its longest (observations of `obs` words are about as many
    # tokens, and each turn adds one and max_new output tokens), so the working set is >= 4x the pool
    longest = system + 16 + (turns + 1) * (obs + 8) + turns * args.max_new
    pool = int(1.3 * longest)
    common = dict(max_running_requests=2, page_size=PAGE, chunked_prefill_size=512)
    results = {}
    for label, extra in (("LRU (tree only)", {}),
                         ("hierarchical", {"enable_hierarchical_cache": True, "hicache_ratio": 10.0})):
        with Engine(args.model, max_total_tokens=pool, **common, **extra) as eng:
            asyncio.run(first_token(eng, tok("warm up").input_ids, 2))
            r = results[label] = run_agent(eng, tok, sessions, turns, system, obs, args.max_new)
        print(f"agent  {label:16} {r['requests'] / r['seconds']:6.2f} req/s  median TTFT {r['median_ttft']:.3f} s  "
              f"hit rate {r['hit_rate']:.0%}  working set {r['working_set']} tokens = "
              f"{r['working_set'] / pool:.1f}x the pool ({pool})", flush=True)
    lru, hier = results["LRU (tree only)"], results["hierarchical"]
    speed = (hier["requests"] / hier["seconds"]) / (lru["requests"] / lru["seconds"])
    ttft_gain = lru["median_ttft"] / hier["median_ttft"]
    print(f"agent  hierarchical vs LRU: {speed:.2f}x req/s, {ttft_gain:.2f}x better median TTFT "
          f"(host hits {hier['hicache']['host_hit_tokens']} tokens)")

    rng = random.Random(3)
    prefix = tok("Reference document. " + text(rng, 1800)).input_ids[:2048 if not args.quick else 1024]
    restart = dict(common, enable_hierarchical_cache=True, hicache_write_policy="write_through")
    with tempfile.TemporaryDirectory() as warm, tempfile.TemporaryDirectory() as cold:
        with Engine(args.model, kv_cache_dir=warm, **restart) as eng:  # the first server computes and writes it
            asyncio.run(first_token(eng, prefix + tok(" Question 0?").input_ids, 4))
        warm_ttft = restart_ttft(args.model, tok, warm, prefix, " Question 1?", restart)
        cold_ttft = restart_ttft(args.model, tok, cold, prefix, " Question 1?", restart)
    print(f"restart  {len(prefix)}-token prefix, first request TTFT: warm disk tier {warm_ttft:.3f} s, cold "
          f"{cold_ttft:.3f} s: {cold_ttft / warm_ttft:.1f}x")
    if args.report:
        report = Report(args.report, "bench_hicache", "Hierarchical cache: host and disk tiers")
        report.text(f"Model: {args.model or 'the bundled SmolLM2-135M-Instruct'}; agent workload of {sessions} "
                    f"sessions x {turns} turns over a {system}-token system prompt, a working set "
                    f"{lru['working_set'] / pool:.1f}x the {pool}-token pool; restart: a {len(prefix)}-token prefix.")
        report.bars("agent", "Agent workload: hierarchical cache vs LRU", ["req/s", "median TTFT (s)"],
                    {"LRU": [lru["requests"] / lru["seconds"], lru["median_ttft"]],
                     "hierarchical": [hier["requests"] / hier["seconds"], hier["median_ttft"]]})
        report.table(["measure", "LRU / cold", "hierarchical / warm", "gain"],
                     [["req/s", f"{lru['requests'] / lru['seconds']:.2f}", f"{hier['requests'] / hier['seconds']:.2f}",
                       f"{speed:.2f}x"],
                      ["median TTFT (s)", f"{lru['median_ttft']:.3f}", f"{hier['median_ttft']:.3f}",
                       f"{ttft_gain:.2f}x"],
                      ["restart first TTFT (s)", f"{cold_ttft:.3f}", f"{warm_ttft:.3f}",
                       f"{cold_ttft / warm_ttft:.1f}x"]])
        report.write()


if __name__ == "__main__":
    main()
