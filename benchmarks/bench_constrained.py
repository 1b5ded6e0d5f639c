"""What does constrained decoding cost, and what does jump-forward save? On the default model:

1. decode throughput at batch 32: the extraction suite's JSON-schema requests beside the same prompts
   unconstrained, EOS ignored; 32 new tokens, fewer than any suite answer, so both runs decode exactly
   batch x 32 tokens at full batch (best of --reps alternating runs: the machine may be shared);
2. time to first token with a cold grammar (never compiled) beside a cached one, prompt cache flushed;
3. jump-forward off beside on, for a schema with long fixed keys: forward passes per output token.

    python benchmarks/bench_constrained.py [--batch 32] [--new-tokens 32] [--dtype float32] [--quick]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "e2e"))

from extraction_suite import CASES, EMAIL, messages  # noqa: E402

from radixgen.runtime.engine import Engine  # noqa: E402

LONG_KEYS = {
    "type": "object",
    "properties": {
        "customer_full_legal_name": {"type": "string", "maxLength": 40},
        "customer_primary_email_address": EMAIL,  # bounded: "format": "email" lets a model loop
        "shipping_address_first_line": {"type": "string", "maxLength": 60},
        "shipping_address_postal_code": {"type": "string", "pattern": "^[0-9]{5}$"},
        "preferred_delivery_time_window": {"enum": ["morning_before_noon", "afternoon_after_noon"]},
        "order_requires_signature_on_delivery": {"type": "boolean"},
    },
    "required": ["customer_full_legal_name", "customer_primary_email_address", "shipping_address_first_line",
                 "shipping_address_postal_code", "preferred_delivery_time_window",
                 "order_requires_signature_on_delivery"],
    "additionalProperties": False,
}
LONG_KEYS_TEXT = ("Ship to Amelia Hart (amelia.hart@example.com), 42 Willow Lane, 30301. She prefers "
                  "afternoon delivery and a signature is required.")


def chat(eng: Engine, content_messages) -> str:
    return eng.tokenizer.apply_chat_template(content_messages, tokenize=False, add_generation_prompt=True)


def stats(eng: Engine) -> dict:
    return eng.get_server_info()["stats"]


def throughput(eng: Engine, batch: int, new_tokens: int, reps: int) -> None:
    cases = [CASES[i % len(CASES)] for i in range(batch)]
    prompts = [chat(eng, messages(c)) for c in cases]
    for c in cases:  # compile outside the timed runs: they measure decoding
        eng.generate(prompts[0], {"max_new_tokens": 1, "json_schema": c.schema})
    variants = {"unconstrained (baseline)": {}, "json_schema": None}
    best: dict[str, tuple[int, float, int]] = {}
    for _ in range(reps):  # alternate the variants and keep each one's best run: the machine is shared
        for label, extra in variants.items():
            params = [{"max_new_tokens": new_tokens, "temperature": 0.0, "ignore_eos": True,
                       **(extra if extra is not None else {"json_schema": c.schema})} for c in cases]
            eng.flush_cache()
            eng.generate(prompts, [{"max_new_tokens": 0}] * batch)  # prompts cached: the run is decode
            before = stats(eng)["decode_passes"]
            t = time.perf_counter()
            out = eng.generate(prompts, params)
            elapsed = time.perf_counter() - t
            tokens = sum(r["meta_info"]["completion_tokens"] for r in out)
            steps = stats(eng)["decode_passes"] - before
            if label not in best or elapsed < best[label][1]:
                best[label] = (tokens, elapsed, steps)
    print(f"\n1. decode throughput, batch {batch}, {new_tokens} new tokens per request, best of {reps}")
    print(f"   {'':26s} {'tokens':>7s} {'seconds':>8s} {'tok/s':>8s} {'decode steps':>13s}")
    for label, (tokens, elapsed, steps) in best.items():
        print(f"   {label:26s} {tokens:7d} {elapsed:8.2f} {tokens / elapsed:8.1f} {steps:13d}")
    (t0, e0, _), (t1, e1, _) = best.values()
    print(f"   constrained / unconstrained tok/s: {t1 / e1 / (t0 / e0):.2f}")
    if t0 != t1:
        print("   (some constrained answers ended before the limit: the batch shrank, compare with care)")


def ttft(eng: Engine, reps: int) -> None:
    case = CASES[0]
    prompt = chat(eng, messages(case))

    def first_token(schema: dict) -> float:
        eng.flush_cache()
        t = time.perf_counter()
        for _ in eng.generate(prompt, {"max_new_tokens": 4, "temperature": 0.0, "json_schema": schema},
                              stream=True):
            return time.perf_counter() - t
        raise RuntimeError("no chunk")

    cold, cached = [], []
    for i in range(reps):
        schema = {**case.schema, "title": f"invoice variant {i} {time.time_ns()}"}  # new text: a cold compile
        cold.append(first_token(schema))
        cached.append(first_token(schema))
    print(f"\n2. time to first token, prompt cache flushed, median of {reps}")
    print(f"   cold grammar (compiled on arrival)  {statistics.median(cold) * 1000:8.1f} ms")
    print(f"   cached grammar (baseline)           {statistics.median(cached) * 1000:8.1f} ms")


def jump_forward_row(eng: Engine) -> tuple[int, int, float, str, str]:
    ask = f"Extract the order details as JSON.\n\n{LONG_KEYS_TEXT}"
    prompt = chat(eng, [{"role": "user", "content": ask}])
    eng.generate(prompt, {"max_new_tokens": 1, "json_schema": LONG_KEYS})  # compile + warm
    eng.flush_cache()
    before = stats(eng)
    t = time.perf_counter()
    out = eng.generate(prompt, {"max_new_tokens": 400, "temperature": 0.0, "json_schema": LONG_KEYS})
    elapsed = time.perf_counter() - t
    passes = stats(eng)["forward_passes"] - before["forward_passes"]
    meta = out["meta_info"]
    return meta["completion_tokens"], passes, elapsed, meta["finish_reason"]["type"], out["text"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--quick", action="store_true", help="batch 8, 16 new tokens, 2 reps")
    args = ap.parse_args()
    if args.quick:
        args.batch, args.new_tokens, args.reps = 8, 16, 2
    print(f"bench_constrained: default model, {args.dtype}, batch {args.batch}")
    with Engine(dtype=args.dtype, max_total_tokens=32768, max_running_requests=max(64, args.batch)) as eng:
        throughput(eng, args.batch, args.new_tokens, args.reps)
        ttft(eng, args.reps)
        off = jump_forward_row(eng)
    with Engine(dtype=args.dtype, max_total_tokens=32768, enable_jump_forward=True) as eng:
        on = jump_forward_row(eng)
    print("\n3. jump-forward, one request, schema with long fixed keys (greedy)")
    print(f"   {'':16s} {'tokens':>7s} {'forward passes':>15s} {'passes/token':>13s} {'seconds':>8s} {'finish':>7s}")
    for label, (tokens, passes, elapsed, finish, _) in (("off (baseline)", off), ("on", on)):
        print(f"   {label:16s} {tokens:7d} {passes:15d} {passes / tokens:13.2f} {elapsed:8.2f} {finish:>7s}")
    print(f"   off: {off[4]}\n   on:  {on[4]}")
    print("   (the forced text is tokenized by the tokenizer, the model may segment it otherwise: outputs can"
          " differ)")


if __name__ == "__main__":
    main()
