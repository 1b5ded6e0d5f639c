"""Multi-LoRA throughput with the default model in bf16: the same requests three ways, in one run.

  no adapter      every request on the base model, all sent at once
  8 mixed         request i on adapter i % 8, all sent at once (every batch holds all eight adapters)
  one at a time   the requests of adapter 0, then those of adapter 1, ... (batches of one adapter each)

The eight adapters are generated here: random PEFT folders (ranks 8 to 16, every projection q/k/v/o and
gate/up/down) on the default model's shapes, all resident (max_loras 8). The modes take turns (A, B, C, A, B,
C...) with the cache flushed before each, and the figures are output tokens per second, best and median.
Targets: mixed >= 0.7x no adapter, and mixed above one at a time.

    python benchmarks/bench_lora.py [--quick] [--requests 64] [--max-new 32] [--rounds 3] [--threads N]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

from radixgen.runtime.config import ModelConfig
from radixgen.runtime.engine import Engine
from radixgen.runtime.loader import read_hf_config, resolve_model_path

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
WORDS = ("river stone market winter lantern orbit copper meadow signal harbor velvet engine "
         "garden thunder pocket silver island canvas mirror forest ladder rocket planet violin").split()


def write_adapter(folder: Path, mc: ModelConfig, rank: int, seed: int) -> None:
    """A random PEFT LoRA folder for a model of config `mc`."""
    h, i = mc.hidden_size, mc.intermediate_size
    q, kv = mc.num_heads * mc.head_dim, mc.num_kv_heads * mc.head_dim
    sizes = {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h),
             "gate_proj": (h, i), "up_proj": (h, i), "down_proj": (i, h)}
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(mc.num_layers):
        for m in TARGETS:
            part = "self_attn" if m in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
            key = f"base_model.model.model.layers.{layer}.{part}.{m}"
            n_in, n_out = sizes[m]
            tensors[f"{key}.lora_A.weight"] = (torch.randn(rank, n_in, generator=gen) / n_in**0.5).to(torch.bfloat16)
            tensors[f"{key}.lora_B.weight"] = (torch.randn(n_out, rank, generator=gen) * 0.02).to(torch.bfloat16)
    folder.mkdir(parents=True)
    (folder / "adapter_config.json").write_text(json.dumps(
        {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": list(TARGETS)}))
    save_file(tensors, str(folder / "adapter_model.safetensors"))


def prompts(tok, n: int, rng: random.Random) -> list[list[int]]:
    return [tok(f"Story {k}: " + " ".join(rng.choice(WORDS) for _ in range(rng.randint(20, 40)))).input_ids
            for k in range(n)]


def timed(eng: Engine, batches: list[tuple[list[list[int]], list[str | None]]], sp: dict) -> float:
    """Output tokens per second over the batches, each sent whole and awaited before the next."""
    eng.flush_cache()
    tokens, t = 0, time.perf_counter()
    for ids, loras in batches:
        for r in eng.generate(input_ids=ids, sampling_params=sp, lora_name=loras):
            tokens += r["meta_info"]["completion_tokens"]
    return tokens / (time.perf_counter() - t)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="fewer requests, shorter outputs, two rounds")
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--max-new", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--adapters", type=int, default=8)
    ap.add_argument("--threads", type=int, default=0, help="scheduler threads (0: torch's default); 1 is steadier "
                    "on a machine other jobs share")
    args = ap.parse_args()
    if args.quick:
        args.requests, args.max_new, args.rounds = 32, 16, 2
    n_ad = args.adapters
    mc = ModelConfig.from_hf(read_hf_config(resolve_model_path(None)))
    rng = random.Random(0)
    with tempfile.TemporaryDirectory(prefix="radixgen-bench-lora-") as tmp:
        ranks = [8 + (16 - 8) * k // max(n_ad - 1, 1) for k in range(n_ad)]
        specs = []
        for k, rank in enumerate(ranks):
            write_adapter(Path(tmp) / f"a{k}", mc, rank, seed=k)
            specs.append(f"a{k}={tmp}/a{k}")
        print(f"{n_ad} adapters, ranks {ranks}; {args.requests} requests x {args.max_new} new tokens", flush=True)
        with Engine(dtype="bfloat16", max_running_requests=max(64, args.requests), lora_paths=tuple(specs),
                    max_loras=n_ad, max_lora_rank=16, num_threads=args.threads) as eng:
            ids = prompts(eng.tokenizer, args.requests, rng)
            names = [f"a{k}" for k in range(n_ad)]
            sp = {"max_new_tokens": args.max_new, "temperature": 0.0, "ignore_eos": True}
            modes = {
                "no adapter": [(ids, [None] * len(ids))],
                f"{n_ad} mixed": [(ids, [names[i % n_ad] for i in range(len(ids))])],
                "one at a time": [([p for i, p in enumerate(ids) if i % n_ad == k], [names[k]] * len(ids[k::n_ad]))
                                  for k in range(n_ad)],
            }
            for batches in modes.values():  # warm-up: every path, every batch size once
                timed(eng, batches, {**sp, "max_new_tokens": 2})
            figures: dict[str, list[float]] = {m: [] for m in modes}
            for rnd in range(args.rounds):
                for mode, batches in modes.items():
                    figures[mode].append(timed(eng, batches, sp))
                print(f"round {rnd + 1}: " + "  ".join(f"{m} {v[-1]:.1f}" for m, v in figures.items()), flush=True)
    base = figures["no adapter"]
    mixed = figures[f"{n_ad} mixed"]
    one = figures["one at a time"]
    print(f"\n{'mode':14} {'best tok/s':>11} {'median tok/s':>13} {'best vs no adapter':>19}")
    for mode, v in figures.items():
        print(f"{mode:14} {max(v):11.1f} {statistics.median(v):13.1f} {max(v) / max(base):18.2f}x")
    ok_base = max(mixed) >= 0.7 * max(base) and statistics.median(mixed) >= 0.7 * statistics.median(base)
    ok_one = max(mixed) > max(one) and statistics.median(mixed) > statistics.median(one)
    print(f"\ntarget mixed >= 0.7x no adapter: {'met' if ok_base else 'MISSED'} "
          f"(best {max(mixed) / max(base):.2f}x, median {statistics.median(mixed) / statistics.median(base):.2f}x)")
    print(f"target mixed > one at a time:    {'met' if ok_one else 'MISSED'} "
          f"(best {max(mixed) / max(one):.2f}x, median {statistics.median(mixed) / statistics.median(one):.2f}x)")


if __name__ == "__main__":
    main()
