"""Data parallelism: the cache-aware router vs round-robin vs one worker, on 2 workers, one run.

The workload is G long shared prefixes (system prompts with background) with short unique questions,
interleaved (group 0, 1, ..., G-1, 0, 1, ...), sent by a few concurrent clients. Each worker's KV pool
(--max-total-tokens) is smaller than the G prefixes together but larger than half of them: a worker that
sees every prefix evicts them in turn (round-robin, one worker), a worker that sees only its own half
keeps them (cache-aware). Printed for each: the prefix-cache hit rate (the workers' cached_tokens /
prompt_tokens deltas from /get_server_info) and requests per second.

    python benchmarks/bench_router.py            # a few minutes on 2 CPU cores (each worker: 1 thread)
    python benchmarks/bench_router.py --groups 9 --rounds 6 --max-total-tokens 3000
    python benchmarks/bench_router.py --report DIR   # also a Markdown report with its plots
"""

from __future__ import annotations

import argparse
import asyncio
import random
import signal
import subprocess
import sys
import time

import httpx
from report import Report, add_report_arg
from serve_proc import free_port, serve_command, start, stop

WORDS = (
    "river stone market winter lantern orbit copper meadow signal harbor velvet engine garden thunder "
    "pocket silver island canvas mirror forest ladder rocket planet violin amber basket candle desert "
    "falcon glacier hammer jungle kettle lemon marble needle oyster pepper quartz ribbon saddle tunnel"
).split()


def workload(groups: int, rounds: int, prefix_words: int, seed: int) -> list[str]:
    """Interleaved: round r sends one question to every group in turn. An odd group count keeps
    round-robin from pinning each group to one worker by accident."""
    rng = random.Random(seed)
    prefixes = [
        f"System {g}: you assist team {g}. Background: " + " ".join(rng.choice(WORDS) for _ in range(prefix_words))
        for g in range(groups)
    ]
    return [f"{prefixes[g]}\nQuestion {r}.{g}: which word comes first?" for r in range(rounds) for g in range(groups)]


def stats(worker_urls: list[str]) -> tuple[int, int]:
    """(prompt tokens, cached tokens) summed over the workers."""
    total = cached = 0
    for url in worker_urls:
        s = httpx.get(url + "/get_server_info", timeout=60).json()["stats"]
        total, cached = total + s["prompt_tokens"], cached + s["cached_tokens"]
    return total, cached


async def send_all(url: str, prompts: list[str], concurrency: int, max_tokens: int) -> float:
    """Every prompt once, `concurrency` at a time in order; returns the wall time. Any failure raises."""
    queue = list(reversed(prompts))

    async def client(http: httpx.AsyncClient) -> None:
        while queue:
            prompt = queue.pop()
            body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
            r = await http.post("/v1/completions", json=body)
            r.raise_for_status()

    async with httpx.AsyncClient(base_url=url, timeout=600) as http:
        t0 = time.perf_counter()
        await asyncio.gather(*(client(http) for _ in range(concurrency)))
        return time.perf_counter() - t0


def run(name: str, entry: str, worker_urls: list[str], prompts: list[str], args) -> dict:
    for w in worker_urls:  # every run starts from empty caches
        httpx.post(w + "/flush_cache", timeout=60).raise_for_status()
    before = stats(worker_urls)
    wall = asyncio.run(send_all(entry, prompts, args.concurrency, args.max_tokens))
    after = stats(worker_urls)
    prompt_tokens, cached = after[0] - before[0], after[1] - before[1]
    return {"name": name, "hit_rate": cached / max(1, prompt_tokens), "req_s": len(prompts) / wall,
            "wall": wall, "prompt_tokens": prompt_tokens}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--groups", type=int, default=7, help="shared prefixes (odd: see workload())")
    p.add_argument("--rounds", type=int, default=4, help="questions per prefix")
    p.add_argument("--prefix-words", type=int, default=300, help="words per prefix (about 1.3 tokens each)")
    p.add_argument("--max-total-tokens", type=int, default=1600,
                   help="each worker's KV pool: below all the prefixes together, above half of them")
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=4, help="output tokens per request")
    p.add_argument("--seed", type=int, default=0)
    add_report_arg(p)
    args = p.parse_args()
    report = Report(args.report, "bench_router", "Router: prefix-cache hit rate by policy") if args.report else None
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(1))  # a kill still stops the servers started here

    prompts = workload(args.groups, args.rounds, args.prefix_words, args.seed)
    py = sys.executable
    ports = [free_port() for _ in range(2)]
    worker_urls = [f"http://127.0.0.1:{port}" for port in ports]
    procs: list[subprocess.Popen] = []
    try:
        for i, port in enumerate(ports):  # one thread each: the machine has 2 cores
            cmd = serve_command(port, "--num-threads", "1", "--max-total-tokens", str(args.max_total_tokens))
            procs.append(start(cmd, worker_urls[i], f"router-worker{i}")[0])
        prefix_tokens = httpx.post(worker_urls[0] + "/tokenize", json={"text": prompts[0]}, timeout=60).json()["count"]
        if args.groups * prefix_tokens <= args.max_total_tokens:
            print("warning: one worker's KV pool holds every prefix: the comparison shows little")
        print(f"workload: {len(prompts)} requests, {args.groups} prefixes of ~{prefix_tokens} tokens "
              f"({args.groups * prefix_tokens} together), each worker's KV pool {args.max_total_tokens} tokens, "
              f"{args.concurrency} concurrent clients, {args.max_tokens} output tokens")
        for w in worker_urls:  # warm-up: first-request costs (kernel loads) out of the measurements
            httpx.post(w + "/v1/completions", json={"prompt": "warm up", "max_tokens": 2}, timeout=600)

        results = []
        for policy in ("cache_aware", "round_robin"):
            port = free_port()
            url = f"http://127.0.0.1:{port}"
            router, _ = start([py, "-m", "radixgen.router", "--port", str(port), "--policy", policy,
                               "--log-level", "warning", "--worker-urls", *worker_urls], url, f"router-{policy}")
            try:
                results.append(run(f"router {policy} (2 workers)", url, worker_urls, prompts, args))
            finally:
                stop(router)
        results.append(run("one worker (no router)", worker_urls[0], worker_urls[:1], prompts, args))
    finally:
        for proc in procs:
            stop(proc)

    print(f"{'setup':32} {'hit rate':>9} {'req/s':>7} {'wall s':>7}")
    for r in results:
        print(f"{r['name']:32} {r['hit_rate']:9.1%} {r['req_s']:7.2f} {r['wall']:7.1f}")
    ca, rr = results[0], results[1]
    hit_ratio = ca["hit_rate"] / max(rr["hit_rate"], 1e-9)
    speedup = ca["req_s"] / rr["req_s"]
    print(f"cache-aware vs round-robin: hit rate x{hit_ratio:.2f} (target >= 1.5), "
          f"req/s x{speedup:.2f} (target >= 1.3)")
    if report is not None:
        write_report(report, results, len(prompts), args)
    return 0


def write_report(report: Report, results: list[dict], requests: int, args) -> None:
    report.text(f"{requests} requests over {args.groups} shared prefixes of {args.prefix_words} words, interleaved, "
                f"from {args.concurrency} concurrent clients; each worker's KV pool holds {args.max_total_tokens} "
                "tokens: less than every prefix together, more than half of them. Hit rate: the workers' cached "
                "tokens over prompt tokens during the run.")
    names = [r["name"].replace(" (2 workers)", "").replace(" (no router)", "") for r in results]
    report.bars("hit-rate", "Prefix-cache hit rate by routing policy (2 workers)", names,
                {"hit rate": [r["hit_rate"] for r in results]}, ylabel="cached / prompt tokens", value_format="{:.0%}")
    report.bars("throughput", "Requests per second by routing policy", names,
                {"req/s": [r["req_s"] for r in results]}, ylabel="requests / s")
    report.table(["setup", "hit rate", "req/s", "wall s"],
                 [[r["name"], f"{r['hit_rate']:.1%}", f"{r['req_s']:.2f}", f"{r['wall']:.1f}"] for r in results])
    report.write()


if __name__ == "__main__":
    raise SystemExit(main())
