"""Online serving: a generated shared-prefix workload against a real radixgen server, cache on vs off.

Each request is one of G long shared prefixes (a system prompt with instructions) followed by a short
unique question, sent to /v1/completions as a stream (greedy, ignore_eos, a fixed output length) at a
Poisson request rate or as fast as a concurrency cap allows. The script starts the server itself, once
with the radix cache and once with --disable-radix-cache, on the same workload, and prints request
and output-token throughput, the prefix-cache hit rate, and TTFT, inter-token latency and end-to-end
latency (median, P95, P99) for both.

    python benchmarks/bench_serving.py                       # ~3-4 minutes on 2 CPU cores
    python benchmarks/bench_serving.py --request-rate 2 --num-prompts 64
    python benchmarks/bench_serving.py --url http://127.0.0.1:30000   # one run against a running server
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import subprocess
import time
from dataclasses import dataclass, field

import httpx
from serve_proc import free_port, serve_command, start, stop

WORDS = (
    "river stone market winter lantern orbit copper meadow signal harbor velvet engine garden thunder "
    "pocket silver island canvas mirror forest ladder rocket planet violin amber basket candle desert "
    "falcon glacier hammer jungle kettle lemon marble needle oyster pepper quartz ribbon saddle tunnel"
).split()


@dataclass
class Result:
    ok: bool
    ttft: float = 0.0
    e2e: float = 0.0
    itl: list[float] = field(default_factory=list)
    output_tokens: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    error: str = ""


def make_workload(num_prompts: int, num_groups: int, prefix_words: int, question_words: int, seed: int):
    """Prompts in a shuffled order: groups interleave, so the cache has to hold every prefix at once."""
    rng = random.Random(seed)

    def words(n: int) -> str:
        return " ".join(rng.choice(WORDS) for _ in range(n))

    prefixes = [
        f"System {g}: you are an assistant for team {g}. Rules and background follow. {words(prefix_words)}\n"
        for g in range(num_groups)
    ]
    prompts = [
        prefixes[i % num_groups] + f"Question {i}: what follows {words(question_words)}? Answer:"
        for i in range(num_prompts)
    ]
    rng.shuffle(prompts)
    return prompts


async def one_request(http: httpx.AsyncClient, model: str, prompt: str, output_len: int) -> Result:
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": output_len,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    start = time.perf_counter()
    res = Result(ok=False)
    last = None
    try:
        async with http.stream("POST", "/v1/completions", json=body) as r:
            if r.status_code != 200:
                res.error = f"HTTP {r.status_code}: {(await r.aread())[:200]!r}"
                return res
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[6:])
                if "error" in event:
                    res.error = event["error"]["message"]
                    return res
                if event.get("usage"):
                    u = event["usage"]
                    res.output_tokens = u["completion_tokens"]
                    res.prompt_tokens = u["prompt_tokens"]
                    res.cached_tokens = (u.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
                if event["choices"] and event["choices"][0]["text"]:
                    now = time.perf_counter()
                    if last is None:
                        res.ttft = now - start
                    else:
                        res.itl.append(now - last)
                    last = now
    except httpx.HTTPError as e:
        res.error = f"{type(e).__name__}: {e}"
        return res
    res.e2e = time.perf_counter() - start
    res.ok = True
    return res


async def run_workload(
    url: str,
    headers: dict,
    model: str,
    prompts: list[str],
    output_len: int,
    request_rate: float,
    concurrency: int,
    seed: int,
) -> tuple[list[Result], float]:
    rng = random.Random(seed + 1)
    limits = httpx.Limits(max_connections=concurrency + 4, max_keepalive_connections=concurrency + 4)
    gate = asyncio.Semaphore(concurrency)
    async with httpx.AsyncClient(base_url=url, headers=headers, timeout=1800, limits=limits) as http:

        async def gated(prompt: str) -> Result:
            async with gate:
                return await one_request(http, model, prompt, output_len)

        start = time.perf_counter()
        tasks = []
        for prompt in prompts:
            tasks.append(asyncio.ensure_future(gated(prompt)))
            if request_rate != float("inf"):
                await asyncio.sleep(rng.expovariate(request_rate))  # Poisson arrivals
        results = await asyncio.gather(*tasks)
        return results, time.perf_counter() - start


# ---------------------------------------------------------------- the server


def start_server(args, disable_cache: bool) -> tuple[subprocess.Popen, str, str]:
    port = free_port()
    flags = ["--dtype", args.dtype]
    if args.model:
        flags += ["--model", args.model]
    if args.num_threads is not None:
        flags += ["--num-threads", str(args.num_threads)]
    if disable_cache:
        flags.append("--disable-radix-cache")
    url = f"http://127.0.0.1:{port}"
    proc, log = start(serve_command(port, *flags), url, "serving")
    return proc, url, log


# ---------------------------------------------------------------- report


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    s = sorted(values)
    k = (len(s) - 1) * q / 100
    lo, hi = int(k), min(int(k) + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def summarize(results: list[Result], duration: float) -> dict[str, float | str]:
    ok = [r for r in results if r.ok]
    itl = [x for r in ok for x in r.itl]
    out_tokens = sum(r.output_tokens for r in ok)
    prompt_tokens = sum(r.prompt_tokens for r in ok)
    row: dict[str, float | str] = {
        "completed / failed": f"{len(ok)} / {len(results) - len(ok)}",
        "duration (s)": duration,
        "request throughput (req/s)": len(ok) / duration,
        "output throughput (tok/s)": out_tokens / duration,
        "prompt tokens (total)": prompt_tokens,
        "prefix cache hit rate": sum(r.cached_tokens for r in ok) / max(prompt_tokens, 1),
    }
    for name, values in (("TTFT", [r.ttft for r in ok]), ("ITL", itl), ("E2E latency", [r.e2e for r in ok])):
        for q in (50, 95, 99):
            label = "median" if q == 50 else f"P{q}"
            row[f"{name} {label} (ms)"] = pct(values, q) * 1000
    return row


def print_table(rows: dict[str, dict]) -> None:
    names = list(rows)
    keys = list(next(iter(rows.values())))
    width = max(len(k) for k in keys) + 2
    col = max(16, *(len(n) + 3 for n in names))
    print("\n" + "".ljust(width) + "".join(n.rjust(col) for n in names))
    for k in keys:
        cells = []
        for n in names:
            v = rows[n][k]
            cells.append(
                (v if isinstance(v, str) else f"{v:,.3f}" if abs(v) < 10 else f"{v:,.1f}").rjust(col)
            )
        print(k.ljust(width) + "".join(cells))
    if len(names) == 2:
        a, b = (rows[n] for n in names)
        speedup = a["request throughput (req/s)"] / max(b["request throughput (req/s)"], 1e-9)
        print(f"\nrequest throughput, {names[0]} / {names[1]}: {speedup:.2f}x")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default=None, help="HF folder or .gguf (default: the bundled SmolLM2-135M)")
    p.add_argument("--dtype", default="bfloat16")
    # on a 2-core box the server's HTTP process and this client need a core: one scheduler thread is
    # several times faster there than torch's default (spinning threads fight over the cores)
    p.add_argument("--num-threads", type=int, default=1, help="scheduler torch threads (0: torch's default)")
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--num-groups", type=int, default=4, help="distinct shared prefixes")
    p.add_argument("--prefix-words", type=int, default=240, help="words per shared prefix (~1.3 tokens each)")
    p.add_argument("--question-words", type=int, default=8)
    p.add_argument("--output-len", type=int, default=16)
    p.add_argument(
        "--request-rate", type=float, default=float("inf"), help="req/s, Poisson; inf: all at once"
    )
    p.add_argument("--concurrency", type=int, default=16, help="at most this many requests in flight")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--url", default=None, help="benchmark a running server instead (one run, no cache toggle)"
    )
    p.add_argument("--api-key", default=os.environ.get("RADIXGEN_API_KEY"))
    args = p.parse_args()

    prompts = make_workload(
        args.num_prompts, args.num_groups, args.prefix_words, args.question_words, args.seed
    )
    rate = (
        "inf (all at once)" if args.request_rate == float("inf") else f"{args.request_rate} req/s (Poisson)"
    )
    print(
        f"workload: {len(prompts)} prompts, {args.num_groups} shared prefixes of ~{args.prefix_words} words, "
        f"{args.output_len} output tokens each; rate {rate}, concurrency {args.concurrency}"
    )
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}

    def bench(url: str) -> dict:
        model = httpx.get(url + "/v1/models", headers=headers, timeout=30).json()["data"][0]["id"]
        # warm-up on an unrelated prompt: first-call costs stay out of the figures, the cache stays cold
        asyncio.run(
            run_workload(url, headers, model, ["Warm up: one two three"], 2, float("inf"), 1, args.seed)
        )
        results, duration = asyncio.run(
            run_workload(
                url, headers, model, prompts, args.output_len, args.request_rate, args.concurrency, args.seed
            )
        )
        failed = [r.error for r in results if not r.ok]
        if failed:
            print(f"  {len(failed)} request(s) failed, e.g. {failed[0]}")
        return summarize(results, duration)

    rows = {}
    if args.url:
        rows["server"] = bench(args.url.rstrip("/"))
    else:
        for name, disable in (("radixgen cache", False), ("radixgen no-cache", True)):
            t0 = time.perf_counter()
            proc, url, log = start_server(args, disable)
            print(f"{name}: server up in {time.perf_counter() - t0:.1f}s (log {log})", flush=True)
            try:
                rows[name] = bench(url)
            finally:
                stop(proc)
            print(f"{name}: done in {time.perf_counter() - t0:.1f}s", flush=True)
    print_table(rows)


if __name__ == "__main__":
    main()
