"""`radixgen bench latency | throughput | serve | cache`: benchmarks shipped with the package. Each prints a table
and, with --output FILE.json, writes its settings and results. Workloads are generated (random tokens or words):
nothing is downloaded."""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import sys
import time
from pathlib import Path
from typing import Any

from radixgen.cli.common import add_engine_args, engine_kwargs, print_table, start_engine

DESCRIPTION = __doc__.removeprefix("`radixgen bench latency | throughput | serve | cache`: ").replace("\n", " ")
COMPARE = ("llama.cpp",)


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def _sizes(text: str) -> list[int]:
    try:
        sizes = [int(x) for x in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not sizes or min(sizes) < 1:
        raise argparse.ArgumentTypeError(f"batch sizes must be >= 1, got {text!r}")
    return sizes


def _rate(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be > 0 (inf: all at once), got {text}")
    return value


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--output", metavar="FILE.json", help="write the settings and results as JSON")
    p.add_argument("--workload-seed", dest="workload_seed", type=int, default=0, help="seed of the generated "
                   "workload (--seed is the engine's)")


def add_args(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="bench", required=True, metavar="BENCHMARK")
    lat = sub.add_parser("latency", help="prefill and decode at given lengths and batch sizes (in-process)")
    lat.add_argument("--input-len", type=_positive, default=128, help="prompt tokens")
    lat.add_argument("--output-len", type=_positive, default=32, help="generated tokens")
    lat.add_argument("--batch-sizes", type=_sizes, default=[1, 8], metavar="B,B,...", help="default 1,8")
    lat.add_argument("--iters", type=_positive, default=3, help="runs per batch size (the median is reported)")
    lat.add_argument("--compare", choices=COMPARE, help="also run llama-cpp-python on the same GGUF file (batch 1)")
    thr = sub.add_parser("throughput", help="offline throughput over synthetic prompts (in-process)")
    thr.add_argument("--num-prompts", type=_positive, default=64)
    thr.add_argument("--input-len", type=_positive, default=128, help="mean prompt tokens (each +- 50%%)")
    thr.add_argument("--output-len", type=_positive, default=32)
    srv = sub.add_parser("serve", help="a running server under load: TTFT / TPOT / ITL percentiles, goodput")
    srv.add_argument("--url", help="the server, e.g. http://127.0.0.1:30000 (required)")
    srv.add_argument("--api-key", help="the server's API key")
    srv.add_argument("--served-model", help="the model name to send (default: the first of /v1/models)")
    srv.add_argument("--num-prompts", type=_positive, default=32)
    srv.add_argument("--input-len", type=_positive, default=64, help="words per prompt (after the shared prefix)")
    srv.add_argument("--shared-prefix-len", type=int, default=0, help="words of a prefix every prompt shares")
    srv.add_argument("--output-len", type=_positive, default=32)
    srv.add_argument("--request-rate", type=_rate, default=float("inf"), help="requests per second, Poisson "
                     "arrivals (default inf: all at once)")
    srv.add_argument("--max-concurrency", type=_positive, help="the most requests in flight")
    srv.add_argument("--percentiles", default="50,90,99", help="comma-separated (default 50,90,99)")
    srv.add_argument("--goodput", nargs="+", default=[], metavar="METRIC:MS",
                     help="objectives for goodput, e.g. ttft:500 tpot:50 e2e:3000")
    cache = sub.add_parser("cache", help="few-shot, multi-turn and agent workloads with the radix cache on and off")
    cache.add_argument("--workloads", default="few-shot,multi-turn,agent", help="comma-separated subset")
    cache.add_argument("--requests", type=_positive, default=16, help="requests per workload")
    cache.add_argument("--output-len", type=_positive, default=16)
    for p in (lat, thr, cache):
        add_engine_args(p)
    for p in (lat, thr, srv, cache):
        _common(p)


def _write(args: argparse.Namespace, results: Any, settings: dict[str, Any]) -> None:
    if not args.output:
        return
    doc = {"benchmark": args.bench, "settings": settings, "results": results,
           "machine": {"platform": platform.platform(), "python": sys.version.split()[0]},
           "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    Path(args.output).write_text(json.dumps(doc, indent=2, default=str) + "\n")
    print(f"wrote {args.output}", file=sys.stderr)


def _settings(args: argparse.Namespace) -> dict[str, Any]:
    return {k: v for k, v in vars(args).items() if k not in ("output",) and v is not None}


def run(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    if args.bench == "serve":
        return _serve(args, parser)
    kwargs = engine_kwargs(args)
    model = kwargs.pop("model", None)
    if args.bench == "cache":
        from radixgen.cli.bench_offline import WORKLOADS

        names = [w.strip() for w in args.workloads.split(",") if w.strip()]
        bad = [w for w in names if w not in WORKLOADS]
        if bad or not names:
            parser.error(f"argument --workloads: unknown workload {bad[0] if bad else args.workloads!r} "
                         f"(known: {', '.join(WORKLOADS)})")
        if kwargs.get("disable_radix_cache"):
            parser.error("argument --disable-radix-cache: `bench cache` runs with the cache and without it")
    try:
        engine = start_engine(model, kwargs)
    except (ValueError, RuntimeError, OSError) as e:
        print(f"radixgen bench {args.bench}: {e}", file=sys.stderr)
        return 1
    from radixgen.cli import bench_offline as off

    try:
        if args.bench == "cache":
            rows = off.cache(engine, names, args.requests, args.output_len, args.workload_seed)
        elif args.bench == "latency":
            rows = off.latency(engine, args.input_len, args.output_len, args.batch_sizes, args.iters,
                               args.workload_seed)
        else:
            rows = off.throughput(engine, args.num_prompts, args.input_len, args.output_len, args.workload_seed)
        model_path = engine.model_info["model_path"]
    finally:
        engine.shutdown()
    if args.bench == "latency" and args.compare == "llama.cpp":
        rows += _llama_cpp(args, model, kwargs, model_path)
    print_table(rows)
    _write(args, rows, _settings(args))
    return 0


def _llama_cpp(args: argparse.Namespace, model: str | None, kwargs: dict, model_path: str) -> list[dict]:
    """llama-cpp-python's rows on the same file, or a message saying why there are none."""
    from radixgen.cli.bench_offline import llama_cpp_latency, note
    from radixgen.runtime.loader import default_gguf_path

    gguf = str(default_gguf_path()) if model is None else model
    if not gguf.endswith(".gguf"):
        note(f"--compare llama.cpp: {gguf} is not a .gguf file (llama.cpp runs GGUF files): skipped")
        return []
    got = llama_cpp_latency(gguf, args.input_len, args.output_len, args.iters, kwargs.get("num_threads"),
                            args.workload_seed)
    if isinstance(got, str):
        note(f"--compare llama.cpp: {got}")
        return []
    return got


def _serve(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    from radixgen.cli import bench_serve as bs
    from radixgen.cli.talk import RemoteError, RemoteModel

    if not args.url:
        parser.error("argument --url: `bench serve` measures a running server: give its URL")
    if not args.url.startswith(("http://", "https://")):
        parser.error(f"argument --url: expected an http(s) URL, got {args.url!r}")
    try:
        percentiles = [float(p) for p in args.percentiles.split(",")]
        if not all(0 < p <= 100 for p in percentiles):
            raise ValueError
    except ValueError:
        parser.error(f"argument --percentiles: expected numbers in (0, 100], got {args.percentiles!r}")
    try:
        slo = bs.parse_goodput(args.goodput)
    except ValueError as e:
        parser.error(f"argument --goodput: {e}")
    try:
        remote = RemoteModel(args.url, args.api_key, args.served_model)
        remote.close()
    except (RemoteError, OSError) as e:
        print(f"radixgen bench serve: {e}", file=sys.stderr)
        return 1
    prompts = bs.workload(args.num_prompts, args.input_len, max(args.shared_prefix_len, 0), args.workload_seed)
    results, duration = asyncio.run(bs.run_load(args.url, args.api_key, remote.name, prompts, args.output_len,
                                                args.request_rate, args.max_concurrency, args.workload_seed))
    summary = bs.summarize(results, duration, percentiles, slo)
    print(f"completed {summary['completed']}, failed {summary['failed']} in {duration:.2f} s: "
          f"{summary['request_throughput']:.2f} req/s, {summary['output_throughput']:.1f} output tok/s, "
          f"cache hit rate {summary['cache_hit_rate']:.1%}"
          + (f", goodput {summary['goodput']:.2f} req/s" if slo else ""))
    print_table(bs.table_rows(summary, percentiles))
    for err in summary["errors"]:
        print(f"error: {err}", file=sys.stderr)
    _write(args, summary, {**_settings(args), "model": remote.name})
    return 0 if summary["completed"] else 1
