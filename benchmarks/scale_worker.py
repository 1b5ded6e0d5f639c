"""One engine under bench_scale.py, in its own process: `python scale_worker.py radixgen|llama MODEL [options]`.
It loads MODEL, prints one JSON line (load seconds, resident memory), then answers one JSON command per stdin line
with one JSON line on stdout. Both engines get the same commands and the same token ids (drawn from the command's
seed), so they take turns on the same work:

    {"op": "prefill", "n": 512, "seed": 1}             -> {"s": seconds for a fresh n-token prompt to its first token}
    {"op": "decode", "b": 8, "ctx": 16, "n": 32, "seed": 2} -> {"s": seconds per decode step of b sequences}
    {"op": "rss"}                                      -> {"rss": bytes, "hwm": peak bytes}

The llama.cpp side runs in llama-cpp-python's own venv and imports nothing of radixgen (nor numpy or torch); it
drives llama.cpp's C API (the `llama_cpp` bindings) directly: one llama_decode per prompt (llama.cpp splits it
into its micro-batches) and per decode step, b sequences in one batch with a unified KV cache.
"""

from __future__ import annotations

import json
import os
import random
import sys
import time
from pathlib import Path

VOCAB_LO, VOCAB_HI = 1000, 48000  # plain tokens of the bundled model's vocabulary (no special ones)


def ids(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(VOCAB_LO, VOCAB_HI) for _ in range(n)]


def proc_mem(pid: int | str = "self") -> tuple[int, int]:
    """(VmRSS, VmHWM) of a process, in bytes."""
    vals = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            key, _, rest = line.partition(":")
            if key in ("VmRSS", "VmHWM"):
                vals[key] = int(rest.split()[0]) * 1024
    return vals.get("VmRSS", 0), vals.get("VmHWM", 0)


def descendants(pid: int) -> list[int]:
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        try:
            with open(f"/proc/{p}/task/{p}/children") as f:
                kids = [int(k) for k in f.read().split()]
        except OSError:
            continue
        out += kids
        todo += kids
    return out


class Radixgen:
    """The model loaded as a user loads a .gguf: Engine(model=path), its defaults apart from `quantization`."""

    def __init__(self, model: str | None, quantization: str | None, threads: int) -> None:
        import radixgen
        from radixgen.runtime.engine import Engine
        from radixgen.runtime.loader import resolve_model_path

        kw = {} if quantization in (None, "default") else {"quantization": quantization}
        if threads:
            kw["num_threads"] = threads
        resolve_model_path(model, kw.get("quantization", "auto"))  # the one-time cache folder, outside the timing
        t = time.perf_counter()
        self.engine = Engine(model=model, **kw)
        self.load_s = time.perf_counter() - t
        self.info = {"dtype": self.engine.model_info["dtype"], "kv_slots": self.engine.model_info["num_kv_slots"],
                     "threads": threads or "default", "quantization": quantization or "default",
                     "source": str(Path(radixgen.__file__).parent)}

    def _gen(self, prompts: list[list[int]], new: int) -> float:
        t = time.perf_counter()
        self.engine.generate(input_ids=prompts, sampling_params=[
            {"max_new_tokens": new, "ignore_eos": True, "temperature": 0.0} for _ in prompts])
        return time.perf_counter() - t

    def prefill(self, n: int, seed: int) -> float:
        return self._gen([ids(seed, n)], 1)

    def decode(self, b: int, ctx: int, n: int, seed: int) -> float:
        """Two runs over the same cached prompts, 1 and n + 1 new tokens each; the difference is n decode steps
        (a prompt seen before is in the radix cache: neither run prefills it again)."""
        prompts = [ids(seed * 1000 + i, ctx) for i in range(b)]
        self._gen(prompts, 1)  # into the cache (a no-op when this seed ran before)
        one = self._gen(prompts, 1)
        many = self._gen(prompts, n + 1)
        return max(many - one, 1e-9) / n

    def mem(self) -> tuple[int, int]:
        """The largest process under this one (the scheduler, which holds the weights and the KV pool)."""
        mems = [proc_mem(p) for p in descendants(os.getpid())]
        return max(mems, default=(0, 0))


class LlamaCpp:
    def __init__(self, model: str, threads: int, max_batch: int, ctx: int) -> None:
        import llama_cpp as L

        self.L = L
        self._quiet = L.llama_log_callback(lambda *a: None)  # kept: llama.cpp calls it for as long as it runs
        L.llama_log_set(self._quiet, None)
        L.llama_backend_init()
        t = time.perf_counter()
        self.model = L.llama_model_load_from_file(model.encode(), L.llama_model_default_params())
        if not self.model:
            raise RuntimeError(f"llama.cpp could not load {model}")
        cp = L.llama_context_default_params()  # llama.cpp's own defaults (flash attention: auto)
        cp.n_ctx = max_batch * 64 + ctx + 256
        cp.n_batch = 2048
        cp.n_seq_max = max_batch
        cp.kv_unified = True  # every sequence may use the whole context, as radixgen's shared pool
        cp.n_threads = cp.n_threads_batch = threads
        self.ctx = L.llama_init_from_model(self.model, cp)
        if not self.ctx:
            raise RuntimeError("llama.cpp could not create a context")
        self.load_s = time.perf_counter() - t
        self.mem_h = L.llama_get_memory(self.ctx)
        self.n_vocab = L.llama_vocab_n_tokens(L.llama_model_get_vocab(self.model))
        self.batch = L.llama_batch_init(2048, 0, max_batch)
        self.state = None  # (b, ctx, seed) whose prompts are in the KV cache
        self.info = {"n_ctx": cp.n_ctx, "threads": threads}

    def _run(self, toks: list[tuple[int, int, int]], logits_from: int) -> None:
        """toks: (token, position, sequence); logits for the entries from index `logits_from` on."""
        L, bt = self.L, self.batch
        for start in range(0, len(toks), 2048):
            chunk = toks[start:start + 2048]
            bt.n_tokens = len(chunk)
            for i, (tok, pos, seq) in enumerate(chunk):
                bt.token[i], bt.pos[i], bt.n_seq_id[i] = tok, pos, 1
                bt.seq_id[i][0] = seq
                bt.logits[i] = start + i >= logits_from
            if L.llama_decode(self.ctx, bt) != 0:
                raise RuntimeError("llama_decode failed")

    def prefill(self, n: int, seed: int) -> float:
        self.L.llama_memory_clear(self.mem_h, True)
        self.state = None
        toks = [(t, p, 0) for p, t in enumerate(ids(seed, n))]
        t = time.perf_counter()
        self._run(toks, n - 1)
        return time.perf_counter() - t

    def decode(self, b: int, ctx: int, n: int, seed: int) -> float:
        L = self.L
        if self.state != (b, ctx, seed):
            L.llama_memory_clear(self.mem_h, True)
            toks = [(t, p, s) for s in range(b) for p, t in enumerate(ids(seed * 1000 + s, ctx))]
            self._run(toks, len(toks))
            self.state = (b, ctx, seed)
        for s in range(b):  # back to the prompts alone
            L.llama_memory_seq_rm(self.mem_h, s, ctx, -1)
        # the next tokens given, not sampled: llama.cpp's sampler over 49k logits is ~0.1 ms in C
        nxt = [ids(seed * 1000 + 500 + s, n) for s in range(b)]
        t = time.perf_counter()
        for step in range(n):
            self._run([(nxt[s][step], ctx + step, s) for s in range(b)], 0)
        return (time.perf_counter() - t) / n

    def mem(self) -> tuple[int, int]:
        return proc_mem()


def main() -> None:
    engine, model = sys.argv[1], sys.argv[2]
    opts = json.loads(sys.argv[3]) if len(sys.argv) > 3 else {}
    max_batch, ctx = int(opts.get("max_batch", 8)), int(opts.get("ctx", 4096))
    if engine == "radixgen":
        e = Radixgen(None if model == "default" else model, opts.get("quantization"), int(opts.get("threads", 0)))
    elif engine == "llama":
        e = LlamaCpp(model, int(opts.get("threads") or os.cpu_count() or 1), max_batch, ctx)
    else:
        raise SystemExit(f"unknown engine {engine!r}: radixgen or llama")
    rss, hwm = e.mem()
    print(json.dumps({"load_s": e.load_s, "rss": rss, "hwm": hwm, **e.info}), flush=True)
    for line in sys.stdin:
        cmd = json.loads(line)
        op = cmd.pop("op")
        if op == "quit":
            break
        if op == "rss":
            rss, hwm = e.mem()
            print(json.dumps({"rss": rss, "hwm": hwm}), flush=True)
            continue
        print(json.dumps({"s": getattr(e, op)(**cmd)}), flush=True)
    if engine == "radixgen":
        e.engine.shutdown()


if __name__ == "__main__":
    main()
