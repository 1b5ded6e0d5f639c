"""SGLang's own serving benchmark (`sglang.benchmark.serving`, formerly `python -m sglang.bench_serving`)
against a radixgen server: `--backend sglang` (the native /generate, streamed) and `--backend sglang-oai`
(/v1/completions), on its `random` dataset, small numbers.

The script starts `radixgen serve` itself, runs SGLang's benchmark once per backend on the same prompts,
and prints SGLang's own report for each, then a summary table of its figures side by side.

Offline: SGLang's `random` dataset takes its text from a ShareGPT file it would download; a ShareGPT-shaped
file is generated here instead (`--dataset-path`), and the tokenizer is the served model's own folder
(`--tokenizer`, from /get_model_info). SGLang is installed without its server dependencies, in a folder of
its own that the benchmark's process gets on its path (the Makefile: `pip install --no-deps --target
.venv/extras-sglang sglang`): two modules that the benchmark imports but never uses for this
dataset (Hugging Face `datasets`, for MMMU; SGLang's disaggregation utils, which pull in torchvision) are
replaced by stand-ins before it is imported; nothing on the request path is.

    python benchmarks/bench_sglang_serving.py                    # ~2 minutes on 2 CPU cores
    python benchmarks/bench_sglang_serving.py --num-prompts 32 --request-rate 4
    python benchmarks/bench_sglang_serving.py --url http://127.0.0.1:30000   # a running server
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile

import httpx
from serve_proc import free_port, serve_command, start, stop

BACKENDS = ("sglang", "sglang-oai")
SGLANG_TARGET = os.path.join(sys.prefix, "extras-sglang")  # where the Makefile installs SGLang (--target)
FIGURES = (  # (key in SGLang's result JSON, label)
    ("completed", "completed requests"),
    ("request_throughput", "requests/s"),
    ("input_throughput", "input tok/s"),
    ("output_throughput", "output tok/s"),
    ("median_ttft_ms", "median TTFT (ms)"),
    ("p99_ttft_ms", "P99 TTFT (ms)"),
    ("median_itl_ms", "median ITL (ms)"),
    ("median_e2e_latency_ms", "median E2E (ms)"),
)
WORDS = (
    "river stone market winter lantern orbit copper meadow signal harbor velvet engine garden thunder "
    "pocket silver island canvas mirror forest ladder rocket planet violin amber basket candle desert "
    "falcon glacier hammer jungle kettle lemon marble needle oyster pepper quartz ribbon saddle tunnel"
).split()

# Run inside the child process: the stand-ins for the two unused imports, then SGLang's benchmark CLI.
RUNNER = """
import runpy, sys, types
datasets = types.ModuleType("datasets")
def load_dataset(*args, **kwargs):
    raise RuntimeError("Hugging Face datasets is not installed (only the MMMU dataset needs it)")
datasets.load_dataset = load_dataset
sys.modules.setdefault("datasets", datasets)
disagg = types.ModuleType("sglang.srt.disaggregation.utils")
disagg.FAKE_BOOTSTRAP_HOST = "2.2.2.2"  # SGLang's value; only prefill/decode disaggregation reads it
sys.modules["sglang.srt.disaggregation.utils"] = disagg
sys.argv = ["sglang.benchmark.serving", *sys.argv[1:]]
runpy.run_module("sglang.benchmark.serving", run_name="__main__")
"""


def make_sharegpt_file(path: str, conversations: int, seed: int) -> None:
    """A ShareGPT-shaped JSON file (what SGLang's `random` dataset samples its text from)."""
    rng = random.Random(seed)

    def sentence() -> str:
        return " ".join(rng.choice(WORDS) for _ in range(rng.randint(6, 16))).capitalize() + "."

    data = [
        {"id": str(i), "conversations": [
            {"from": "human", "value": " ".join(sentence() for _ in range(rng.randint(2, 8)))},
            {"from": "gpt", "value": " ".join(sentence() for _ in range(rng.randint(2, 8)))},
        ]}
        for i in range(conversations)
    ]
    with open(path, "w") as f:
        json.dump(data, f)


def start_server(args) -> tuple[subprocess.Popen, str, str]:
    port = free_port()
    flags = ["--dtype", args.dtype]
    if args.model:
        flags += ["--model", args.model]
    if args.num_threads is not None:
        flags += ["--num-threads", str(args.num_threads)]
    url = f"http://127.0.0.1:{port}"
    proc, log = start(serve_command(port, *flags), url, "sglang-serving")
    return proc, url, log


def run_bench(args, url: str, backend: str, dataset: str, tokenizer: str, model: str, out: str) -> dict:
    cmd = [
        sys.executable, "-c", RUNNER,
        # --model is the local folder (its tokenizer config is read), --served-model-name what requests name
        "--backend", backend, "--base-url", url, "--model", tokenizer, "--served-model-name", model,
        "--tokenizer", tokenizer,
        "--dataset-name", "random", "--dataset-path", dataset,
        "--num-prompts", str(args.num_prompts), "--random-input-len", str(args.input_len),
        "--random-output-len", str(args.output_len), "--random-range-ratio", str(args.range_ratio),
        "--request-rate", str(args.request_rate), "--max-concurrency", str(args.max_concurrency),
        "--seed", str(args.seed),
        # as many warm-up requests as run at once: the server's first batches of each size pay one-time costs
        # (oneDNN primitives, the fused step's buffers) that would otherwise land on the first backend measured
        "--warmup-requests", str(args.max_concurrency), "--disable-tqdm", "--output-file", out,
        "--flush-cache",  # each backend starts from an empty radix cache (same prompts in both runs)
    ]
    # offline: the tokenizer is a local folder; the hub is never asked (it would retry for a minute)
    env = {**os.environ, "PYTHONWARNINGS": "ignore", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    if os.path.isdir(SGLANG_TARGET):
        env["PYTHONPATH"] = os.pathsep.join(p for p in (SGLANG_TARGET, env.get("PYTHONPATH")) if p)
    subprocess.run(cmd, check=True, env=env)  # prints SGLang's own report
    with open(out) as f:
        return json.loads(f.read().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url", help="benchmark a running server instead of starting one")
    ap.add_argument("--model", help="the model to serve (default: the bundled SmolLM2-135M-Instruct)")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--num-threads", type=int)
    ap.add_argument("--backends", nargs="+", default=list(BACKENDS), choices=BACKENDS)
    ap.add_argument("--num-prompts", type=int, default=16)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=32)
    ap.add_argument("--range-ratio", type=float, default=0.5)
    ap.add_argument("--request-rate", type=float, default=float("inf"))
    ap.add_argument("--max-concurrency", type=int, default=8)
    ap.add_argument("--seed", type=int, default=1)
    args = ap.parse_args()

    proc = None
    if args.url:
        url = args.url.rstrip("/")
    else:
        proc, url, log = start_server(args)
        print(f"radixgen server at {url} (log: {log})")
    results = {}
    try:
        with tempfile.TemporaryDirectory(prefix="bench-sglang-") as tmp:
            dataset = os.path.join(tmp, "sharegpt.json")
            make_sharegpt_file(dataset, conversations=max(64, 4 * args.num_prompts), seed=args.seed)
            info = httpx.get(url + "/get_model_info", timeout=30).json()
            model = httpx.get(url + "/v1/models", timeout=30).json()["data"][0]["id"]
            for backend in args.backends:
                print(f"\n### sglang.benchmark.serving --backend {backend}", flush=True)
                out = os.path.join(tmp, f"{backend}.jsonl")
                results[backend] = run_bench(args, url, backend, dataset, info["model_path"], model, out)
    finally:
        if proc is not None:
            stop(proc)

    print(f"\nSGLang bench_serving against radixgen: random dataset, {args.num_prompts} prompts, "
          f"input ~{args.input_len} / output ~{args.output_len} tokens (range ratio {args.range_ratio}), "
          f"max concurrency {args.max_concurrency}")
    print(f"{'':24}" + "".join(f"{b:>14}" for b in results))
    for key, label in FIGURES:
        cells = []
        for r in results.values():
            v = r.get(key)
            cells.append(f"{v:>14.2f}" if isinstance(v, float) else f"{v!s:>14}")
        print(f"{label:24}" + "".join(cells))


if __name__ == "__main__":
    main()
