"""Does speculative decoding pay, and where? On the default model (bf16), greedy, speculation on beside off in
one run, the engines taking turns (A, B, A, B ...: the machine may be shared):

1. n-gram drafts on three workloads, batch 1 and 8: extraction (answers that copy spans of their documents: the
   documents and questions are below), chat (open questions: little to copy), JSON (the extraction suite's
   schemas, constrained). Output tok/s (best and median of the turns), forward passes per output token, the
   share of draft tokens accepted, and whether every greedy output is the baseline's, token for token.
2. the draft-model path with a draft that never agrees with the target (a tiny random model of the same
   vocabulary): its cost per verified token (the draft model's forwards, prefill included, per token the
   target verified) and what adaptive drafting leaves of it in tok/s.

Each turn starts from a flushed cache with the prompts prefilled (a run of max_new_tokens 0), so the timed run
is decoding and the radix tree holds no earlier outputs to draft from.

    python benchmarks/bench_speculative.py [--reps 3] [--new-tokens 96] [--threads 2] [--quick] [--report DIR]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "e2e"))
sys.path.insert(0, str(ROOT / "tests"))

from extraction_suite import CASES, messages  # noqa: E402
from report import Report, add_report_arg  # noqa: E402
from tiny_models import tiny_model_dir  # noqa: E402

from radixgen.runtime.engine import Engine  # noqa: E402

DOCUMENTS = [
    """From: Daniel Okafor <d.okafor@brightline-logistics.example>
To: Priya Raman <priya.raman@harbourfoods.example>
Subject: Revised delivery schedule for order HF-20931

Hi Priya,

Following our call this morning, here is the revised schedule. The first shipment of 120 pallets of canned \
tomatoes will leave our Rotterdam depot on Tuesday 14 May and arrive at your Leeds warehouse on Friday 17 May. \
The second shipment of 80 pallets of olive oil will follow on Monday 20 May, arriving on Thursday 23 May. Both \
shipments will be handled by our partner carrier, Northsea Freight BV, under contract number NSF-7741-22.

Please note that the unloading bay at Leeds must be available between 06:00 and 10:00 on both arrival days, \
because the drivers are not allowed to wait longer than two hours. If the bay is not available, the pallets \
will be returned to Rotterdam at your expense.

Best regards,
Daniel Okafor
Senior Account Manager, Brightline Logistics""",
    """SERVICE AGREEMENT - SECTION 7: TERMINATION

7.1 Either party may terminate this Agreement by giving the other party at least ninety (90) days' written \
notice. 7.2 The Client may terminate this Agreement with immediate effect if the Provider fails to meet the \
availability target of 99.5 percent in any three consecutive calendar months. 7.3 Upon termination, the \
Provider shall return all Client data within thirty (30) days in a commonly used, machine-readable format, and \
shall delete all remaining copies within a further fourteen (14) days. 7.4 Fees paid in advance for services \
not yet delivered shall be refunded on a pro rata basis within sixty (60) days of the termination date.""",
    """Product data sheet: AquaPure 3000 under-sink water filter

Model number: AP-3000-W. Filtration stages: five (sediment, activated carbon block, reverse osmosis membrane, \
post carbon, remineralisation). Flow rate: 1.9 litres per minute at 4 bar. Operating pressure: 2.5 to 6 bar. \
Operating temperature: 4 to 38 degrees Celsius. Tank capacity: 12 litres. Membrane life: 24 months under normal \
use. Replacement cartridge set: AP-3000-RC, recommended every 6 months. Dimensions: 380 x 140 x 420 mm. Weight: \
9.6 kg. Warranty: 3 years on the housing, 1 year on the electronic leak detector.""",
    """Minutes of the facilities committee, 3 April

Present: Laura Chen (chair), Marcus Webb, Ines Duarte, Tom Fairley. Apologies: Sanjay Patel.
1. The roof repair on the east wing was completed on 28 March at a final cost of 42,300 pounds, 2,100 pounds \
under budget. 2. The committee approved the replacement of the boiler in building C; Marcus Webb will obtain \
three quotes by 30 April. 3. The car park will be resurfaced during the summer closure, from 22 July to 9 \
August; staff will be told to use the overflow car park on Mill Lane. 4. The next meeting will be held on \
8 May at 10:00 in room 2.14.""",
]
QUESTIONS = [
    "Copy, word for word, the sentences of the document that give dates.",
    "Quote the most important paragraph of the document exactly as it is written.",
]
CHATS = [
    "Why is the sky blue? Explain it to a ten-year-old.",
    "Write a short poem about autumn in a small town.",
    "What are three good habits for learning a new language?",
    "Give me a simple recipe for a vegetable soup.",
    "What is the difference between a virus and a bacterium?",
    "Suggest a name for a bakery and explain your choice.",
    "How do I politely decline an invitation to a party?",
    "Describe the water cycle in a few sentences.",
]


def chat_prompt(eng: Engine, msgs: list[dict[str, str]]) -> str:
    return eng.tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)


def workloads(eng: Engine, batch: int, new_tokens: int) -> dict[str, tuple[list[str], list[dict]]]:
    greedy = {"max_new_tokens": new_tokens, "temperature": 0.0}
    extraction = [chat_prompt(eng, [{"role": "user", "content": f"{d}\n\n{q}"}])
                  for q in QUESTIONS for d in DOCUMENTS]
    chats = [chat_prompt(eng, [{"role": "user", "content": c}]) for c in CHATS]
    cases = CASES[:batch]
    json_prompts = [chat_prompt(eng, messages(c)) for c in cases]
    return {
        "extraction": (extraction[:batch], [greedy] * batch),
        "chat": (chats[:batch], [greedy] * batch),
        "json": (json_prompts, [{**greedy, "json_schema": c.schema} for c in cases]),
    }


def timed(eng: Engine, prompts: list[str], params: list[dict]) -> tuple[float, list[list[int]], dict]:
    eng.flush_cache()
    eng.generate(prompts, [{"max_new_tokens": 0}] * len(prompts))  # the prompts cached: the run decodes
    before = eng.get_server_info()
    t = time.perf_counter()
    out = eng.generate(prompts, params)
    elapsed = time.perf_counter() - t
    after = eng.get_server_info()
    delta = {k: after["stats"].get(k, 0) - before["stats"].get(k, 0) for k in after["stats"]}
    if after["speculative"] is not None:
        delta["draft_seconds"] = after["speculative"]["draft_seconds"] - before["speculative"]["draft_seconds"]
    return elapsed, [o["output_ids"] for o in out], delta


def compare(engines: dict[str, Engine], prompts, params, reps: int) -> dict[str, dict]:
    """Each engine `reps` times, taking turns; per engine its times, its outputs (the last turn's) and the
    counters of its last turn."""
    res: dict[str, dict] = {name: {"times": []} for name in engines}
    for eng in engines.values():  # warm: grammars compiled, scratch buffers sized
        eng.generate(prompts, [{**p, "max_new_tokens": 2} for p in params])
    for _ in range(reps):
        for name, eng in engines.items():
            elapsed, ids, delta = timed(eng, prompts, params)
            res[name]["times"].append(elapsed)
            res[name]["ids"], res[name]["delta"] = ids, delta
    return res


def row(label: str, r: dict, base: dict | None) -> str:
    tokens = sum(len(i) for i in r["ids"])
    best, med = tokens / min(r["times"]), tokens / statistics.median(r["times"])
    d = r["delta"]
    passes = d["forward_passes"] / tokens
    drafted = d.get("spec_draft_tokens", 0)
    acc = f"{d['spec_accepted_tokens'] / drafted:7.0%}" if drafted else "      -"
    speed = same = ""
    if base is not None:
        b_tokens = sum(len(i) for i in base["ids"])
        speed = f"{best / (b_tokens / min(base['times'])):6.2f}x"
        differ = sum(a != b for a, b in zip(r["ids"], base["ids"], strict=True))
        same = "yes" if differ == 0 else f"no ({differ} of {len(r['ids'])} differ)"
    return f"   {label:22s} {tokens:6d} {best:8.1f} {med:8.1f} {speed:>7s} {passes:9.2f} {acc} {same}"


HEADER = (f"   {'':22s} {'tokens':>6s} {'best t/s':>8s} {'med t/s':>8s} {'speedup':>7s} {'passes/tok':>9s} "
          f"{'accept':>7s} identical greedy output")


def ngram_section(off: Engine, on: Engine, batches: list[int], new_tokens: int, reps: int,
                  names: list[str]) -> dict[tuple[int, str], dict]:
    """Prints the section; returns each (batch, workload)'s results (compare's) for the report."""
    print("\n1. n-gram drafts (speedup: best tok/s over the baseline's best)")
    results = {}
    for batch in batches:
        loads = workloads(off, batch, new_tokens)
        for name in names:
            prompts, params = loads[name]
            res = compare({"off": off, "ngram": on}, prompts, params, reps)
            results[(batch, name)] = res
            print(f"\n   {name}, batch {len(prompts)}, {new_tokens} new tokens at most, {reps} turns each")
            print(HEADER)
            print(row("off (baseline)", res["off"], None))
            print(row("ngram", res["ngram"], res["off"]))
    return results


def write_report(report: Report, results: dict[tuple[int, str], dict], batches: list[int], names: list[str],
                 args) -> None:
    def best_tps(r: dict) -> float:
        return sum(len(i) for i in r["ids"]) / min(r["times"])

    def accepted(r: dict) -> float:
        d = r["delta"]
        return d["spec_accepted_tokens"] / d["spec_draft_tokens"] if d.get("spec_draft_tokens") else 0.0

    report.text(f"n-gram speculative decoding on the default model (bf16, greedy, {args.threads} threads), "
                f"{args.new_tokens} new tokens at most, {args.reps} turns each, speculation on and off taking turns "
                "in one run. Acceptance: the share of draft tokens the target kept; speed-up: best output tok/s "
                "against the same run's baseline without speculation (the dashed line).")
    report.bars("acceptance", "Share of n-gram draft tokens accepted", names,
                {f"batch {b}": [accepted(results[(b, n)]["ngram"]) for n in names] for b in batches},
                ylabel="accepted / drafted", value_format="{:.0%}")
    report.bars("speedup", "Output tok/s with n-gram drafts against without", names,
                {f"batch {b}": [best_tps(results[(b, n)]["ngram"]) / best_tps(results[(b, n)]["off"]) for n in names]
                 for b in batches}, ylabel="speed-up (x)", baseline=1.0)
    rows = []
    for (b, n), res in results.items():
        same = all(a == c for a, c in zip(res["ngram"]["ids"], res["off"]["ids"], strict=True))
        rows.append([n, b, f"{best_tps(res['off']):.1f}", f"{best_tps(res['ngram']):.1f}",
                     f"{accepted(res['ngram']):.0%}", "yes" if same else "no"])
    report.table(["workload", "batch", "off tok/s", "ngram tok/s", "accepted", "identical greedy output"], rows)
    report.write()


def draft_section(off: Engine, draft: Engine, new_tokens: int, reps: int) -> None:
    prompts, params = workloads(off, 1, new_tokens)["extraction"]
    res = compare({"off": off, "draft": draft}, prompts, params, reps)
    d = res["draft"]["delta"]
    verified = d["generation_tokens"] + d["spec_draft_tokens"]  # each kept token, and each draft, was verified
    print("\n2. draft model: a tiny random model of the same vocabulary drafting for the default model (batch 1, "
          "extraction)")
    print(HEADER)
    print(row("off (baseline)", res["off"], None))
    print(row("draft (tiny random)", res["draft"], res["off"]))
    print(f"   draft model time per verified token: {d['draft_seconds'] / verified * 1000:.2f} ms "
          f"({d['draft_seconds']:.2f} s over {verified} verified tokens, {d['spec_draft_tokens']} of them drafts)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--new-tokens", type=int, default=96)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--quick", action="store_true", help="batch 1 only, 48 new tokens, 2 turns, no draft model")
    add_report_arg(ap)
    args = ap.parse_args()
    report = Report(args.report, "bench_speculative", "Speculative decoding: acceptance") if args.report else None
    batches, names = [1, 8], ["extraction", "chat", "json"]
    if args.quick:
        batches, args.new_tokens, args.reps = [1], 48, 2
    common = dict(dtype="bfloat16", num_threads=args.threads, max_total_tokens=16384, max_running_requests=16,
                  context_length=2048)  # the tiny draft model of section 2 has 2048 positions
    print(f"bench_speculative: default model, bf16, {args.threads} threads")
    with Engine(**common) as off, Engine(**common, speculative_algorithm="ngram") as on:
        results = ngram_section(off, on, batches, args.new_tokens, args.reps, names)
        if not args.quick:
            with Engine(**common, speculative_algorithm="draft",
                        speculative_draft_model=str(tiny_model_dir("llama"))) as draft:
                draft_section(off, draft, args.new_tokens, args.reps)
    if report is not None:
        write_report(report, results, batches, names, args)


if __name__ == "__main__":
    main()
