"""`radixgen bench serve`: a running server under load, as `vllm bench serve` and SGLang's bench_serving measure
it: requests to /v1/completions, streamed, at a Poisson request rate or under a concurrency cap; TTFT, TPOT (time
per output token after the first), ITL (the gaps between streamed chunks) and end-to-end latency percentiles,
throughput, and goodput (completed requests per second that met every --goodput objective)."""

from __future__ import annotations

import asyncio
import json
import random
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from radixgen.cli.bench_offline import words
from radixgen.cli.common import progress

GOODPUT_METRICS = ("ttft", "tpot", "e2e")


@dataclass
class Result:
    ok: bool = False
    ttft: float = 0.0
    e2e: float = 0.0
    itl: list[float] = field(default_factory=list)
    output_tokens: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    error: str = ""

    @property
    def tpot(self) -> float | None:
        return (self.e2e - self.ttft) / (self.output_tokens - 1) if self.output_tokens > 1 else None


def parse_goodput(items: list[str]) -> dict[str, float]:
    """["ttft:500", "tpot:50"] -> {"ttft": 0.5, "tpot": 0.05} (milliseconds in, seconds out); ValueError naming
    the item."""
    slo = {}
    for item in items:
        name, _, ms = item.partition(":")
        if name not in GOODPUT_METRICS:
            raise ValueError(f"{item!r}: the metric must be one of {', '.join(GOODPUT_METRICS)}")
        try:
            value = float(ms)
        except ValueError:
            raise ValueError(f"{item!r}: expected METRIC:MILLISECONDS") from None
        if not value > 0:
            raise ValueError(f"{item!r}: the objective must be > 0 ms")
        slo[name] = value / 1000
    return slo


def workload(num_prompts: int, input_words: int, shared_prefix_words: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    prefix = f"System: {words(rng, shared_prefix_words)}\n" if shared_prefix_words else ""
    return [f"{prefix}Request {i}: {words(rng, input_words)}" for i in range(num_prompts)]


async def one_request(client, model: str, prompt: str, output_len: int) -> Result:
    body = {"model": model, "prompt": prompt, "max_tokens": output_len, "temperature": 0.0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    res = Result()
    t0 = last = time.perf_counter()
    chunks = 0
    try:
        async with client.stream("POST", "/v1/completions", json=body) as r:
            if r.status_code != 200:
                res.error = f"{r.status_code}: {(await r.aread()).decode(errors='replace')[:300]}"
                return res
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[6:])
                usage = event.get("usage")
                if usage:
                    res.output_tokens = usage.get("completion_tokens", 0)
                    res.prompt_tokens = usage.get("prompt_tokens", 0)
                    res.cached_tokens = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0) or 0
                if any(c.get("text") for c in event.get("choices") or []):
                    now = time.perf_counter()
                    if chunks == 0:
                        res.ttft = now - t0
                    else:
                        res.itl.append(now - last)
                    last, chunks = now, chunks + 1
        res.e2e = time.perf_counter() - t0
        res.output_tokens = res.output_tokens or chunks
        res.ok = True
    except Exception as e:  # noqa: BLE001 - a failed request is counted, the run goes on
        res.error = f"{type(e).__name__}: {e}"
    return res


async def run_load(url: str, api_key: str | None, model: str, prompts: list[str], output_len: int,
                   request_rate: float, max_concurrency: int | None, seed: int) -> tuple[list[Result], float]:
    import httpx

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    limit = max_concurrency or len(prompts)
    sem = asyncio.Semaphore(limit)
    rng = random.Random(seed)
    bar = progress(len(prompts), "requests")

    async with httpx.AsyncClient(base_url=url.rstrip("/"), headers=headers, timeout=httpx.Timeout(600.0),
                                 limits=httpx.Limits(max_connections=limit, max_keepalive_connections=limit)) as client:
        async def limited(prompt: str) -> Result:
            async with sem:
                res = await one_request(client, model, prompt, output_len)
            bar.update(1)
            return res

        t0 = time.perf_counter()
        tasks = []
        for i, prompt in enumerate(prompts):
            if i and request_rate != float("inf"):
                await asyncio.sleep(rng.expovariate(request_rate))  # Poisson arrivals
            tasks.append(asyncio.create_task(limited(prompt)))
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - t0
    bar.close()
    return list(results), duration


def summarize(results: list[Result], duration: float, percentiles: list[float], slo: dict[str, float]) -> dict:
    ok = [r for r in results if r.ok]
    out_tokens = sum(r.output_tokens for r in ok)
    prompt_tokens = sum(r.prompt_tokens for r in ok)
    summary: dict[str, Any] = {
        "completed": len(ok), "failed": len(results) - len(ok), "duration_s": duration,
        "request_throughput": len(ok) / duration, "output_throughput": out_tokens / duration,
        "total_token_throughput": (out_tokens + prompt_tokens) / duration,
        "prompt_tokens": prompt_tokens, "output_tokens": out_tokens,
        "cache_hit_rate": sum(r.cached_tokens for r in ok) / max(prompt_tokens, 1),
        "errors": sorted({r.error for r in results if not r.ok})[:5],
    }
    series = {"ttft": [r.ttft for r in ok], "tpot": [r.tpot for r in ok if r.tpot is not None],
              "itl": [g for r in ok for g in r.itl], "e2e": [r.e2e for r in ok]}
    for name, values in series.items():
        arr = np.array(values or [0.0]) * 1000  # ms
        summary[f"mean_{name}_ms"] = float(arr.mean())
        summary[f"median_{name}_ms"] = float(np.median(arr))
        for p in percentiles:
            summary[f"p{p:g}_{name}_ms"] = float(np.percentile(arr, p))
    if slo:
        good = [r for r in ok if all((getattr(r, m) or 0.0) <= limit for m, limit in slo.items())]
        summary["goodput"] = len(good) / duration
        summary["goodput_objectives_ms"] = {m: v * 1000 for m, v in slo.items()}
    return summary


def table_rows(summary: dict, percentiles: list[float]) -> list[dict]:
    rows = []
    for name, label in (("ttft", "TTFT"), ("tpot", "TPOT"), ("itl", "ITL"), ("e2e", "E2E")):
        row = {"METRIC (ms)": label, "mean": summary[f"mean_{name}_ms"], "median": summary[f"median_{name}_ms"]}
        row.update({f"p{p:g}": summary[f"p{p:g}_{name}_ms"] for p in percentiles})
        rows.append(row)
    return rows
