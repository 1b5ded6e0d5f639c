"""The in-process benchmarks of `radixgen bench`: latency (prefill, decode at batch sizes), throughput (offline,
synthetic prompts), cache (few-shot, multi-turn and agent workloads with the radix cache on and off), and
llama-cpp-python on the same GGUF file for `--compare llama.cpp`."""

from __future__ import annotations

import random
import statistics
import sys
import time
from typing import Any

from radixgen.cli.common import progress

WORDS = ("river stone market winter lantern orbit copper meadow signal harbor velvet engine garden thunder pocket "
         "silver island canvas mirror forest ladder rocket planet violin amber basket candle desert falcon glacier "
         "hammer jungle kettle lemon marble needle oyster pepper quartz ribbon saddle tunnel").split()


def words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


def _greedy(n: int) -> dict[str, Any]:
    # a fixed output length: ignore_eos, so every run decodes exactly n tokens
    return {"max_new_tokens": n, "temperature": 0.0, "ignore_eos": True}


def random_ids(engine, rng: random.Random, n: int, length: int) -> list[list[int]]:
    """Token ids drawn from the tokenizer's vocabulary, above its special tokens."""
    top = min(len(engine.tokenizer), engine.limits.vocab_size) - 1
    return [[rng.randint(100, top) for _ in range(length)] for _ in range(n)]


def latency(engine, input_len: int, output_len: int, batch_sizes: list[int], iters: int, seed: int) -> list[dict]:
    """Per batch size: the prefill of `input_len`-token prompts (a 1-token generation), then the whole generation;
    decode = the difference over output_len - 1 steps. The cache is flushed first: nothing comes from it."""
    rng = random.Random(seed)
    engine.generate(input_ids=random_ids(engine, rng, 1, 8), sampling_params=_greedy(2))  # warm-up
    rows = []
    bar = progress(len(batch_sizes) * iters, "latency")
    for b in batch_sizes:
        prefill, total = [], []
        for _ in range(iters):
            for out, times in ((1, prefill), (output_len, total)):
                engine.flush_cache()
                ids = random_ids(engine, rng, b, input_len)
                t0 = time.perf_counter()
                engine.generate(input_ids=ids, sampling_params=_greedy(out))
                times.append(time.perf_counter() - t0)
            bar.update(1)
        p, t = statistics.median(prefill), statistics.median(total)
        steps = max(output_len - 1, 1)
        decode = max(t - p, 1e-9)
        rows.append({"engine": "radixgen", "batch": b, "input_len": input_len, "output_len": output_len,
                     "prefill_ms": p * 1e3, "prefill_tok_s": b * input_len / p,
                     "decode_ms_per_step": decode / steps * 1e3, "decode_tok_s": b * steps / decode, "total_s": t})
    bar.close()
    return rows


def throughput(engine, num_prompts: int, input_len: int, output_len: int, seed: int) -> list[dict]:
    """All prompts at once (lengths input_len +- 50%, distinct: no prefix sharing), a fixed output length."""
    rng = random.Random(seed)
    engine.generate(input_ids=random_ids(engine, rng, 1, 8), sampling_params=_greedy(2))  # warm-up
    engine.flush_cache()
    ids = [random_ids(engine, rng, 1, rng.randint(max(1, input_len // 2), input_len * 3 // 2))[0]
           for _ in range(num_prompts)]
    t0 = time.perf_counter()
    outs = engine.generate(input_ids=ids, sampling_params=_greedy(output_len))
    seconds = time.perf_counter() - t0
    prompt_tokens = sum(map(len, ids))
    output_tokens = sum(o["meta_info"]["completion_tokens"] for o in outs)
    return [{"engine": "radixgen", "requests": num_prompts, "prompt_tokens": prompt_tokens,
             "output_tokens": output_tokens, "seconds": seconds, "requests_s": num_prompts / seconds,
             "output_tok_s": output_tokens / seconds, "total_tok_s": (prompt_tokens + output_tokens) / seconds}]


# ---------------------------------------------------------------- cache workloads

def few_shot(rng: random.Random, requests: int) -> list[list[str]]:
    """One few-shot prefix (8 worked examples), then `requests` questions: each a conversation of one prompt."""
    shots = "".join(f"Example {i}: {words(rng, 40)}\nAnswer: {words(rng, 8)}\n\n" for i in range(8))
    return [[f"{shots}Question: {words(rng, 12)}\nAnswer:"] for _ in range(requests)]


def multi_turn(rng: random.Random, requests: int) -> list[list[str]]:
    """Conversations of 4 turns: each turn's prompt is the last one with a reply and a new question appended."""
    convs = []
    for c in range(max(1, requests // 4)):
        text, turns = f"Conversation {c}. {words(rng, 30)}\n", []
        for _ in range(4):
            text += f"User: {words(rng, 25)}\nAssistant:"
            turns.append(text)
            text += f" {words(rng, 20)}\n"
        convs.append(turns)
    return convs


def agent(rng: random.Random, requests: int) -> list[list[str]]:
    """Agents sharing one long tool description; each step appends a call and its observation."""
    tools = "Tools:\n" + "".join(f"- tool_{i}(x): {words(rng, 30)}\n" for i in range(6))
    runs = []
    for a in range(max(1, requests // 4)):
        text, steps = f"{tools}Task {a}: {words(rng, 20)}\n", []
        for s in range(4):
            text += "Thought:"
            steps.append(text)
            text += f" call tool_{s}({words(rng, 3)})\nObservation: {words(rng, 40)}\n"
        runs.append(steps)
    return runs


WORKLOADS = {"few-shot": few_shot, "multi-turn": multi_turn, "agent": agent}


def run_workload(engine, convs: list[list[str]], output_len: int, use_cache: bool, bar) -> dict[str, Any]:
    """Conversations interleaved turn by turn (the cache must hold several at once), one request at a time. Without
    the cache, the tree is flushed before each request (outside the timing): one request at a time, that is the
    same work as --disable-radix-cache, on the same engine."""
    prompt = cached = out = 0
    seconds = 0.0
    for turn in range(max(map(len, convs))):
        for conv in convs:
            if turn < len(conv):
                if not use_cache:
                    engine.flush_cache()
                t0 = time.perf_counter()
                r = engine.generate(conv[turn], sampling_params=_greedy(output_len))
                seconds += time.perf_counter() - t0
                meta = r["meta_info"]
                prompt, cached, out = prompt + meta["prompt_tokens"], cached + meta["cached_tokens"], \
                    out + meta["completion_tokens"]
                bar.update(1)
    return {"requests": sum(map(len, convs)), "prompt_tokens": prompt, "cached_tokens": cached,
            "hit_rate": cached / max(prompt, 1), "seconds": seconds, "tok_s": (prompt + out) / seconds}


def cache(engine, workloads: list[str], requests: int, output_len: int, seed: int) -> list[dict]:
    """Each workload with the radix cache, then without (the same prompts, the tree flushed before each)."""
    engine.generate("warm up", sampling_params=_greedy(2))
    rows = []
    for name in workloads:
        for use_cache in (True, False):
            convs = WORKLOADS[name](random.Random(seed), requests)
            mode = "on" if use_cache else "off"
            bar = progress(sum(map(len, convs)), f"{name}, cache {mode}")
            rows.append({"workload": name, "cache": mode, **run_workload(engine, convs, output_len, use_cache, bar)})
            bar.close()
        rows[-2]["speedup"] = rows[-1]["seconds"] / rows[-2]["seconds"]
    return rows


# ---------------------------------------------------------------- llama.cpp

def llama_cpp_latency(gguf_path: str, input_len: int, output_len: int, iters: int, threads: int | None,
                      seed: int) -> list[dict] | str:
    """llama-cpp-python on the same GGUF file at batch 1 (prefill, then greedy decode steps); or why it did not
    run."""
    try:
        from llama_cpp import Llama
    except ImportError:
        return "llama-cpp-python is not importable (pip install llama-cpp-python): skipped"
    llm = Llama(model_path=gguf_path, n_ctx=input_len + output_len + 8, n_batch=max(input_len, 8), n_threads=threads,
                verbose=False, seed=seed)
    rng = random.Random(seed)
    top = llm.n_vocab() - 1
    prefill, decode = [], []
    for _ in range(iters):
        llm.reset()
        ids = [rng.randint(100, top) for _ in range(input_len)]
        t0 = time.perf_counter()
        llm.eval(ids)
        t1 = time.perf_counter()
        for _ in range(output_len - 1):
            llm.eval([int(llm.scores[llm.n_tokens - 1].argmax())])
        prefill.append(t1 - t0)
        decode.append(time.perf_counter() - t1)
    p, d = statistics.median(prefill), statistics.median(decode)
    steps = max(output_len - 1, 1)
    return [{"engine": "llama.cpp", "batch": 1, "input_len": input_len, "output_len": output_len,
             "prefill_ms": p * 1e3, "prefill_tok_s": input_len / p, "decode_ms_per_step": d / steps * 1e3,
             "decode_tok_s": steps / max(d, 1e-9), "total_s": p + d}]


def note(text: str) -> None:
    print(text, file=sys.stderr, flush=True)
