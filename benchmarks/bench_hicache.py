"""The hierarchical cache's payoff, in one run, with the default model (SmolLM2-135M-Instruct) unless --model says
otherwise:

  agent        16 agent sessions over one 512-token system prompt and tool list shared by all, 12 turns each: a
               tool result (120 words, about 160 tokens: a search hit, a file excerpt, a test log) and a short reply
               (the tool call; 4 tokens, what both systems decode alike). Each turn's prompt is the whole
               conversation so far. At most --parallel requests are in flight (4: the agents whose tools have
               returned, the others waiting on theirs), the sessions taking turns in a ring, so each one's next
               turn comes after every other session's; --parallel 0 sends every session's next turn at once, turn
               after turn (bursts of 16). The pool holds about one conversation at its longest: the working set is
               several times the pool (printed, with the host tier's size). Today's LRU tree keeps the shared
               system prompt and recomputes every session's own turns; the hierarchical cache keeps them in its
               host tier (by default sized to hold the working set) and loads them back. Prints requests/s, the
               median time to first token and where prompt tokens came from (pool, host tier, disk tier,
               computed) for both. --sessions / --turns / --system / --obs / --pool-factor change the shape.
  restart      a 2k-token shared prefix (1k with --quick) served by a server that is then shut down; a new server
               over the same --kv-cache-dir (warm disk tier) against one over an empty folder (cold): the first
               request's time to first token.

    python benchmarks/bench_hicache.py [--quick] [--part all|agent|restart] [--parallel P] [--model PATH]
                                       [--report DIR]
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import tempfile
import time
from collections import deque

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


def agent_sessions(tok, rng: random.Random, sessions: int, system: int) -> tuple[list[int], list]:
    """The shared system prompt and tool list, and each session's opening task."""
    prefix = agent_prefix(tok, rng, system)
    return prefix, [prefix + tok(f"Task {s}: {text(rng, 12)}\n").input_ids for s in range(sessions)]


def next_turn(tok, rng: random.Random, conv: list[int], t: int, obs: int) -> list[int]:
    """The conversation so far (the model's last reply included) and the tool's result for it."""
    return conv + tok(f"\nTool result {t}: {text(rng, obs)}\nNext step:").input_ids


def agent_sizes(args) -> tuple[int, int, int, int, int]:
    """Sessions, turns, system prompt tokens, tool result words, and the pool's tokens: about one conversation at
    its longest (a tool result of `obs` words is about 1.3 obs tokens), so the working set (the system prompt once,
    every session's own turns) is several times the pool and LRU keeps little beyond the system prompt."""
    shape = dict(zip(("sessions", "turns", "system", "obs"), (10, 6, 256, 40) if args.quick else (16, 12, 512, 120),
                     strict=True))
    sessions, turns, system, obs = (shape[k] if getattr(args, k) is None else getattr(args, k) for k in shape)
    longest = system + 24 + turns * (int(1.3 * obs) + 10 + args.max_new)
    return sessions, turns, system, obs, int(args.pool_factor * longest)


def host_ratio(args, sessions: int, system: int, pool: int) -> float:
    """--hicache-ratio, or by default a host tier that holds the working set (estimated) with a quarter to spare."""
    if args.hicache_ratio is not None:
        return args.hicache_ratio
    longest = pool / args.pool_factor
    return round(1.25 * (system + sessions * (longest - system)) / pool, 1)


def run_agent(eng: Engine, tok, sessions: int, turns: int, system: int, obs: int, max_new: int,
              parallel: int = 0) -> dict:
    """Every session's turns, a turn's prompt being the whole conversation so far plus the last tool result.
    parallel 0: turn after turn, every session's next request at once (a burst of `sessions` requests). parallel
    P > 0: at most P requests in flight (the agents whose tools have returned; the others are waiting on theirs):
    the sessions take turns in a ring, each one's next turn queued behind all the others'. Either way a session's
    conversation comes back after every other session's, so plain LRU has long evicted it."""
    prefix, convs = agent_sessions(tok, random.Random(7), sessions, system)
    ttfts: list[float] = []
    done = [0] * sessions

    async def one(s: int) -> None:
        prompt = next_turn(tok, random.Random(1000 * s + done[s]), convs[s], done[s], obs)
        ttft, out = await first_token(eng, prompt, max_new)
        ttfts.append(ttft)
        convs[s], done[s] = prompt + out, done[s] + 1

    async def ring() -> None:
        queue = deque(range(sessions))

        async def agent() -> None:
            while queue:
                s = queue.popleft()
                await one(s)
                if done[s] < turns:
                    queue.append(s)

        await asyncio.gather(*(agent() for _ in range(parallel)))

    async def bursts() -> None:
        for _ in range(turns):
            await asyncio.gather(*(one(s) for s in range(sessions)))

    t0 = time.perf_counter()
    asyncio.run(ring() if parallel > 0 else bursts())
    seconds = time.perf_counter() - t0
    info = eng.get_server_info()
    return {"requests": sessions * turns, "seconds": seconds, "median_ttft": statistics.median(ttfts),
            "working_set": len(prefix) + sum(len(c) - len(prefix) for c in convs),
            "longest": max(len(c) for c in convs), "hit_rate": info["cache_hit_rate"], "info": info,
            "hicache": info.get("hicache")}


def tier_split(r: dict) -> str:
    """Prompt tokens served by each tier and computed, over the run (the warm-up included)."""
    stats, tiers = r["info"]["stats"], r["hicache"] or {}
    prompt, cached = stats["prompt_tokens"], stats["cached_tokens"]
    host, disk = tiers.get("host_hit_tokens", 0), tiers.get("disk_hit_tokens", 0)
    parts = {"pool": cached - host - disk, "host": host, "disk": disk, "computed": prompt - cached}
    return ", ".join(f"{k} {v / prompt:.0%}" for k, v in parts.items())


def restart_ttft(model, tok, kv_dir: str, prefix: list[int], question: str, common: dict) -> float:
    with Engine(model, kv_cache_dir=kv_dir, **common) as eng:
        asyncio.run(first_token(eng, tok("warm up the kernels").input_ids, 2))
        ttft, _ = asyncio.run(first_token(eng, prefix + tok(question).input_ids, 4))
    return ttft


def restart(args, tok, common: dict) -> tuple[float, float, list[int]]:
    """A server computes a shared prefix and writes it to its disk tier, then exits; a new server over that folder
    (warm) and one over an empty folder (cold) each serve a new question on the prefix: their first TTFT."""
    rng = random.Random(3)
    n = 1024 if args.quick else 2048
    prefix = tok("Reference document. " + text(rng, 2400)).input_ids[:n]
    assert len(prefix) == n, len(prefix)
    restart = dict(common, enable_hierarchical_cache=True, hicache_write_policy="write_through")
    with tempfile.TemporaryDirectory() as warm, tempfile.TemporaryDirectory() as cold:
        with Engine(args.model, kv_cache_dir=warm, **restart) as eng:  # the first server computes and writes it
            asyncio.run(first_token(eng, prefix + tok(" Question 0?").input_ids, 4))
        warm_ttft = restart_ttft(args.model, tok, warm, prefix, " Question 1?", restart)
        cold_ttft = restart_ttft(args.model, tok, cold, prefix, " Question 1?", restart)
    print(f"restart  {len(prefix)}-token prefix, first request TTFT: warm disk tier {warm_ttft:.3f} s, cold "
          f"{cold_ttft:.3f} s: {cold_ttft / warm_ttft:.1f}x", flush=True)
    return warm_ttft, cold_ttft, prefix


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="fewer sessions and a shorter restart prefix")
    ap.add_argument("--model", default=None, help="default: the bundled SmolLM2-135M-Instruct")
    ap.add_argument("--max-new", type=int, default=4)
    for flag, what in (("sessions", "agent sessions"), ("turns", "turns a session"),
                       ("system", "system prompt tokens"), ("obs", "words of each tool result")):
        ap.add_argument(f"--{flag}", type=int, default=None, help=f"{what} (default: the workload's)")
    ap.add_argument("--pool-factor", type=float, default=1.2, help="the pool's tokens as a multiple of the longest "
                    "conversation")
    ap.add_argument("--kv-huge-pages", action="store_true", help="every engine's pool in transparent huge pages "
                    "(the engines' option)")
    ap.add_argument("--max-running", type=int, default=2, help="max_running_requests of both engines")
    ap.add_argument("--num-threads", type=int, default=0, help="torch threads of the engine (0: its default)")
    ap.add_argument("--part", choices=("all", "agent", "restart"), default="all")
    ap.add_argument("--hicache-ratio", type=float, default=None, help="host tier size as a multiple of the pool "
                    "(default: what holds the working set)")
    ap.add_argument("--parallel", type=int, default=4, help="requests in flight at most (agents whose tools have "
                    "returned); 0: every session's next turn at once, turn after turn")
    add_report_arg(ap)
    args = ap.parse_args()
    tok = load_tokenizer(args.model)
    sessions, turns, system, obs, pool = agent_sizes(args)
    common = dict(max_running_requests=args.max_running, page_size=PAGE, chunked_prefill_size=512,
                  num_threads=args.num_threads, kv_huge_pages=args.kv_huge_pages)
    results = {}
    for label, extra in () if args.part == "restart" else (("LRU (tree only)", {}),
                         ("hierarchical", {"enable_hierarchical_cache": True,
                                          "hicache_ratio": host_ratio(args, sessions, system, pool)})):
        with Engine(args.model, max_total_tokens=pool, **common, **extra) as eng:
            asyncio.run(first_token(eng, tok("warm up").input_ids, 2))
            r = results[label] = run_agent(eng, tok, sessions, turns, system, obs, args.max_new, args.parallel)
        host = r["hicache"]["host"] if r["hicache"] else None
        sizes = f"pool {pool} tokens" + (f", host tier {host['capacity_tokens']} tokens ({host['format']}, "
                                         f"{host['memory_bytes'] / 2**20:.0f} MiB)" if host else "")
        print(f"agent  {label:16} {r['requests'] / r['seconds']:6.2f} req/s  median TTFT {r['median_ttft']:.3f} s  "
              f"hit rate {r['hit_rate']:.0%} ({tier_split(r)})  working set {r['working_set']} tokens = "
              f"{r['working_set'] / pool:.1f}x the pool; {sizes}", flush=True)
    if args.part == "restart":
        return restart(args, tok, common)
    lru, hier = results["LRU (tree only)"], results["hierarchical"]
    speed = (hier["requests"] / hier["seconds"]) / (lru["requests"] / lru["seconds"])
    ttft_gain = lru["median_ttft"] / hier["median_ttft"]
    print(f"agent  {sessions} sessions x {turns} turns, {system}-token system prompt, {obs}-word tool results, "
          f"{args.max_new} new tokens a turn, "
          f"{f'{args.parallel} in flight' if args.parallel else 'every session at once'}; hierarchical vs LRU: "
          f"{speed:.2f}x req/s, {ttft_gain:.2f}x better median TTFT", flush=True)
    if args.part == "agent":
        return
    warm_ttft, cold_ttft, prefix = restart(args, tok, common)
    if args.report:
        report = Report(args.report, "bench_hicache", "Hierarchical cache: host and disk tiers")
        report.text(f"Model: {args.model or 'the bundled SmolLM2-135M-Instruct'}; agent workload of {sessions} "
                    f"sessions x {turns} turns over a {system}-token system prompt, {args.parallel or sessions} "
                    f"requests in flight at most, a working set "
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
