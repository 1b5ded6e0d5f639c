"""Structured programs through the DSL (radix cache on) vs the same work as independent requests
(cache off): few-shot select, multi-turn chat, tree-of-thought, JSON extraction.

    python benchmarks/bench_programs.py [--quick]

The baseline is exactly the DSL's work: every request the programs sent (prompts, choice scoring
requests, sampling parameters and constraints) is recorded, then replayed on an Engine with
`disable_radix_cache=True` as independent requests, each one as soon as the requests whose output
its prompt contains have answered (a chat turn after the previous turn, a branch after the text it
continues), all the others at once. The requests the DSL sends only to fill the cache (prefill-only)
are not replayed. Greedy decoding throughout; both engines run side by side, workload by workload.
"""

from __future__ import annotations

import argparse
import random
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, NamedTuple

import radixgen as sgl
from radixgen.lang.backend_engine import EngineBackend

# ------------------------------------------------------------------------------------ workloads

LETTERS = ["A", "B", "C", "D"]


def mcq_item(rng: random.Random) -> tuple[str, str]:
    """A multiple-choice question about four numbers, and its answer letter."""
    kind = rng.choice(["largest", "smallest"])
    numbers = rng.sample(range(1, 100), 4)
    pick = max(numbers) if kind == "largest" else min(numbers)
    options = " ".join(f"{letter}) {n}" for letter, n in zip(LETTERS, numbers, strict=True))
    return f"Which number is the {kind}? {options}\n", LETTERS[numbers.index(pick)]


@sgl.function
def few_shot_select(s, shots, question):
    s += shots
    s += question + "Answer:" + sgl.select("answer", [" A", " B", " C", " D"])


SHOP_FACTS = [
    "The shop opens from 9am to 6pm on weekdays and from 10am to 4pm on Saturdays.",
    "It is closed on Sundays and on public holidays.",
    "It sells new and second-hand books, mostly fiction, history, travel and cookery.",
    "Any book in print can be ordered and arrives within three working days.",
    "Members get ten percent off every purchase and a free coffee on Fridays.",
    "Membership costs twenty pounds a year and can be bought at the till.",
    "Gift cards are sold in any amount and never expire.",
    "The shop is at 12 Harbour Street, next to the post office.",
    "There is no car park, but the Harbour Street car park is two minutes away on foot.",
    "The shop buys second-hand books on Tuesday mornings, by appointment.",
    "Children's story time is on Saturday mornings at 11am and is free.",
    "The reading group meets on the first Thursday of each month at 7pm.",
    "Books can be returned within thirty days with a receipt, for a full refund.",
    "Damaged books are replaced at no cost if reported within a week.",
    "The shop ships books anywhere in the country for three pounds, free above thirty pounds.",
    "Payment is accepted by card, cash or gift card; cheques are not accepted.",
    "The shop has a small café serving tea, coffee and cakes until 5pm.",
    "Dogs are welcome in the shop, but not in the café.",
    "The owner, Ruth, has run the shop since 1998.",
    "Signed first editions are kept in a locked cabinet behind the till.",
    "Author events are announced on the noticeboard and in the monthly newsletter.",
    "The newsletter is free; customers sign up with their email address at the till.",
    "Rare books can be valued on Wednesday afternoons for a fee of ten pounds.",
    "Wheelchair access is through the side door on Mill Lane.",
    "Lost property is kept behind the till for one month.",
]
SYSTEM = (
    "You are a patient assistant for a small bookshop. Answer customers in one short sentence, "
    "using only these facts:\n" + "\n".join(f"- {fact}" for fact in SHOP_FACTS)
)
CHAT_TURNS = [
    ["When do you open on Saturday?", "Do you sell travel guides?", "Can I order a book?", "Thanks!"],
    ["Where is the shop?", "Do members get a discount?", "Do you sell gift cards?", "Can I pay by cheque?"],
    ["Are you open on Sunday?", "Do you have history books?", "How long does an order take?", "Thanks."],
    ["What time do you close on Friday?", "Do you buy used books?", "Is there parking?", "Can dogs come?"],
]


@sgl.function
def multi_turn(s, turns, max_tokens):
    s += sgl.system(SYSTEM)
    for i, question in enumerate(turns):
        s += sgl.user(question)
        s += sgl.assistant(sgl.gen(f"answer_{i}", max_tokens=max_tokens))


@sgl.function
def tree_of_thought(s, question, max_tokens):
    s += sgl.system("You solve problems by comparing several ideas before answering.")
    s += sgl.user(question)
    s += sgl.assistant_begin()
    s += "Let me consider three ideas.\n"
    ideas = s.fork(3)
    for i, idea in enumerate(ideas):
        idea += f"Idea {i + 1}:" + sgl.gen("idea", max_tokens=max_tokens, stop="\n")
        checks = idea.fork(2)
        checks[0] += "\nAdvantage:" + sgl.gen("pro", max_tokens=max_tokens, stop="\n")
        checks[1] += "\nDrawback:" + sgl.gen("con", max_tokens=max_tokens, stop="\n")
        checks.join()
    ideas.join()
    s += "In short:\n" + "\n".join(f"- {idea.strip()}" for idea in s["idea"]) + "\n"  # waits for the join
    s += "After comparing them, the best idea is" + sgl.gen("best", max_tokens=max_tokens)
    s += sgl.assistant_end()


EXTRACT_EXAMPLES = [
    ("Maria Lopez, 34, moved to Valencia last year.", "Maria Lopez", 34, "Valencia"),
    ("In Oslo lives Erik Berg, who just turned 51.", "Erik Berg", 51, "Oslo"),
    ("Aiko Tanaka (27) works as a nurse in Osaka.", "Aiko Tanaka", 27, "Osaka"),
    ("The baker of Lyon, Paul Martin, celebrated his 60th birthday.", "Paul Martin", 60, "Lyon"),
    ("Nadia Haddad is a 45-year-old architect based in Beirut.", "Nadia Haddad", 45, "Beirut"),
    ("Born 19 years ago, Liam Walsh now studies in Dublin.", "Liam Walsh", 19, "Dublin"),
]
EXTRACT_SYSTEM = (
    "Extract the person described in the text as JSON with the fields name, age and city.\n"
    + "".join(
        f'Text: "{text}"\nJSON: {{"name": "{name}", "age": {age}, "city": "{city}"}}\n'
        for text, name, age, city in EXTRACT_EXAMPLES
    )
    + "Answer with the JSON object only."
)
PEOPLE = [
    "Tom Baker, 45, runs a bakery in Leeds.",
    "Lena Fischer is 29 and studies law in Munich.",
    "At 62, Carlos Mendes still teaches music in Porto.",
    "Priya Nair (38) opened a clinic in Pune.",
    "Jonas Weber, a 51-year-old pilot, lives in Zurich.",
    "Sofia Rossi moved to Turin when she was 24, last spring.",
    "Ahmed Saleh, 33, is an engineer in Cairo.",
    "Grace Kim, aged 41, paints murals in Seoul.",
]
PERSON_SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "age": {"type": "integer"}, "city": {"type": "string"}},
    "required": ["name", "age", "city"],
}


@sgl.function
def extract_json(s, text, max_tokens, constrained):
    s += sgl.system(EXTRACT_SYSTEM)
    s += sgl.user(text)
    if constrained:
        s += sgl.assistant(sgl.gen("record", max_tokens=max_tokens, json_schema=PERSON_SCHEMA))
    else:
        s += sgl.assistant(sgl.gen("record", max_tokens=max_tokens, stop="}"))


class Workload(NamedTuple):
    name: str
    program: Any
    arguments: list[dict[str, Any]]


def workloads(quick: bool, constrained: bool) -> list[Workload]:
    rng = random.Random(0)
    shots = "".join(q + f"Answer: {a}\n\n" for q, a in (mcq_item(rng) for _ in range(20)))
    n_mcq, n_chat, n_tot, n_json, gen_tokens = (3, 2, 1, 2, 4) if quick else (4, 3, 1, 4, 8)
    questions = [mcq_item(rng)[0] for _ in range(n_mcq)]
    tot_questions = ["How can a small town reduce traffic?", "How can I learn a language faster?"]
    return [
        Workload("few-shot select (20-shot)", few_shot_select, [{"shots": shots, "question": q} for q in questions]),
        Workload(
            "multi-turn chat (4 turns)",
            multi_turn,
            [{"turns": t, "max_tokens": gen_tokens} for t in CHAT_TURNS[:n_chat]],
        ),
        Workload(
            "tree-of-thought (3x2 forks)",
            tree_of_thought,
            [{"question": q, "max_tokens": gen_tokens} for q in tot_questions[:n_tot]],
        ),
        Workload(
            "JSON extraction" + ("" if constrained else " (unconstrained)"),
            extract_json,
            [{"text": t, "max_tokens": 2 * gen_tokens, "constrained": constrained} for t in PEOPLE[:n_json]],
        ),
    ]


# ------------------------------------------------------------------------ recording and replay


class Replay(NamedTuple):
    text: str | None
    input_ids: list[int] | None
    sampling_params: dict[str, Any]
    return_logprob: bool
    logprob_start_len: int
    output: str  # what it generated ("" for scoring requests)


class RecordingBackend(EngineBackend):
    """The Engine backend, keeping every call that does work for a program (not the prefill-only
    requests that only warm the cache), in the order they were sent."""

    def __init__(self, engine: Any):
        super().__init__(engine)
        self.calls: list[list[Replay]] = []
        self._lock = threading.Lock()

    def generate(self, requests):
        results = super().generate(requests)
        call = []
        for r, result in zip(requests, results, strict=True):
            if r.sampling_params.get("max_new_tokens") == 0 and not r.return_logprob:
                continue  # a cache warm-up: no work of the program's own
            output = (result[0] if isinstance(result, list) else result)["text"]
            call.append(Replay(r.text, r.input_ids, r.sampling_params, r.return_logprob, r.logprob_start_len, output))
        if call:
            with self._lock:
                self.calls.append(call)
        return results

    @property
    def num_requests(self) -> int:
        return sum(len(call) for call in self.calls)


def dependencies(calls: list[list[Replay]], decode) -> list[list[int]]:
    """For each call, the earlier calls whose output its prompt contains: a client without the
    DSL could not send it before those have answered either."""
    prompts = [[r.text if r.text is not None else decode(r.input_ids) for r in call] for call in calls]
    deps = []
    for i, call_prompts in enumerate(prompts):
        needed = []
        for j in range(i):
            produced = [p + r.output for p, r in zip(prompts[j], calls[j], strict=True) if r.output]
            if any(p.startswith(x) for x in produced for p in call_prompts):
                needed.append(j)
        deps.append(needed)
    return deps


def replay_call(engine: Any, call: list[Replay]) -> None:
    """One recorded call: its requests as batched generate calls (one per kind of request)."""
    groups: dict[tuple, list[Replay]] = {}
    for r in call:
        groups.setdefault((r.text is None, r.return_logprob, r.logprob_start_len), []).append(r)
    for (by_ids, return_logprob, start), requests in groups.items():
        params = [r.sampling_params for r in requests]
        source = {"input_ids": [r.input_ids for r in requests]} if by_ids else {"prompt": [r.text for r in requests]}
        engine.generate(**source, sampling_params=params, return_logprob=return_logprob, logprob_start_len=start)


def replay(engine: Any, calls: list[list[Replay]]) -> None:
    """Every call as soon as the calls it depends on have answered, all others at once."""
    deps = dependencies(calls, engine.tokenizer.decode)
    done = [threading.Event() for _ in calls]

    def run(i: int) -> None:
        for j in deps[i]:
            done[j].wait()
        replay_call(engine, calls[i])
        done[i].set()

    with ThreadPoolExecutor(max_workers=max(1, len(calls))) as pool:
        list(pool.map(run, range(len(calls))))


def cache_stats(engine: Any) -> tuple[int, int]:
    stats = engine.get_server_info()["stats"]
    return stats["prompt_tokens"], stats["cached_tokens"]


def hit_rate(before: tuple[int, int], after: tuple[int, int]) -> float:
    prompt, cached = after[0] - before[0], after[1] - before[1]
    return cached / prompt if prompt else 0.0


class Result(NamedTuple):
    seconds: float
    hit_rate: float
    requests: int


# ------------------------------------------------------------------------------------------ main


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer programs and tokens (about a minute)")
    parser.add_argument("--dtype", default=None, help="Engine dtype (default: the Engine's)")
    args = parser.parse_args()
    config = {} if args.dtype is None else {"dtype": args.dtype}

    warm = {"max_new_tokens": 2, "temperature": 0}
    dsl: dict[str, Result] = {}
    base: dict[str, Result] = {}
    # Both engines live side by side and each workload runs on one then the other, so a change in
    # the machine's load hits both sides alike.
    with sgl.Engine(**config) as engine, sgl.Engine(disable_radix_cache=True, **config) as no_cache:
        constrained = bool(engine.model_info.get("supports_constraints"))
        loads = workloads(args.quick, constrained)
        engine.generate("Warm up.", warm)
        no_cache.generate("Warm up.", warm)
        for w in loads:
            engine.flush_cache()
            backend = RecordingBackend(engine)
            before = cache_stats(engine)
            start = time.perf_counter()
            states = w.program.run_batch(w.arguments, backend=backend, temperature=0, progress_bar=False)
            seconds = time.perf_counter() - start
            errors = [s.error() for s in states if s.error() is not None]
            if errors:
                raise errors[0]
            dsl[w.name] = Result(seconds, hit_rate(before, cache_stats(engine)), backend.num_requests)
            if w.program is few_shot_select:
                print(f"  (few-shot select answers: {[s['answer'].strip() for s in states]})")

            before = cache_stats(no_cache)
            start = time.perf_counter()
            replay(no_cache, backend.calls)
            seconds = time.perf_counter() - start
            base[w.name] = Result(seconds, hit_rate(before, cache_stats(no_cache)), backend.num_requests)
            print(f"  {w.name}: radixgen {dsl[w.name].seconds:.1f}s, no cache {seconds:.1f}s")

    print()
    header = (
        f"{'workload':34s} {'programs':>8s} {'requests':>8s} {'radixgen prog/s':>16s} "
        f"{'no-cache prog/s':>16s} {'speedup':>8s} {'hit rate':>9s} {'no-cache':>9s}"
    )
    print(header)
    print("-" * len(header))
    for w in loads:
        n, d, b = len(w.arguments), dsl[w.name], base[w.name]
        print(
            f"{w.name:34s} {n:8d} {d.requests:8d} {n / d.seconds:16.3f} {n / b.seconds:16.3f} "
            f"{b.seconds / d.seconds:7.2f}x {d.hit_rate:9.1%} {b.hit_rate:9.1%}"
        )
    print("\ntargets: >= 3x on few-shot select, >= 2x on multi-turn chat")


if __name__ == "__main__":
    main()
