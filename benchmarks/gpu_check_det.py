"""GPU check, the deterministic mode's part (gpu_check.py runs it; `gpu_check.py --deterministic-only` runs only
this part): the batch-invariant Triton kernels on the device and the mode's cost.

1. Identity on the device at Llama-3-8B shapes: a row of fixed_matmul alone and among 128 rows (and, for
   comparison, of torch's matmul, which may differ); decode_attention_fixed of a request alone and in a batch of
   32; extend_attention_fixed's tokens against decode at their positions and against another chunking.
2. Kernel timings, the batch-invariant variant against the default kernel: the matmul at 1, 32 and 512 rows
   (against cuBLAS), decode attention at batch 1 and 32, extend attention (1024 new tokens after 3072).
3. The Engine with deterministic=True (eager decode: the mode refuses CUDA graphs) on the dummy-weight
   Llama-3-8B-shaped model: a greedy request's ids and logprobs and a seeded top-p request's ids alone, again
   from the radix cache, and among 7 others; decode tokens/s at batch 1 and 8 beside the default Engine, eager
   (and the graphs' figure where gpu_check.py measured it).

Every figure is reported as a row of gpu_check.py's table (section "determ"); `report` is its function.
"""

from __future__ import annotations

import random
import tempfile
from collections.abc import Callable
from pathlib import Path


def _same(a, b) -> str:
    import torch

    return "identical" if torch.equal(a, b) else "DIFFERS"


def kernel_identity(device, smoke: bool, report: Callable) -> None:
    import torch

    from radixgen.kernels import batch_invariant as bi
    from radixgen.kernels.cpu import FIXED_PIECE

    g = torch.Generator().manual_seed(0)
    dt = torch.float32 if smoke else torch.bfloat16
    k, n, m = (64, 96, 8) if smoke else (4096, 14336, 128)
    x = torch.randn(m, k, generator=g).to(dt).to(device)
    w = (torch.randn(n, k, generator=g) / k ** 0.5).to(dt).to(device)
    full, row = bi.fixed_matmul(x, w), m - 3
    report("determ", f"fixed_matmul: row {row} alone vs among {m} rows", _same(bi.fixed_matmul(x[row:row + 1], w)[0],
                                                                           full[row]))
    idx = torch.tensor([row, *range(min(m, 31))], device=device)
    report("determ", "fixed_matmul: the row first in another batch", _same(bi.fixed_matmul(x[idx], w)[0], full[row]))
    report("determ", "torch matmul (cuBLAS): row alone vs among all (default path)",
           _same((x[row:row + 1] @ w.t())[0], (x @ w.t())[row]))

    s = _attention_shapes(smoke)
    q, kb, vb, table, lens = _pool(s, device, dt, g)
    rows = torch.arange(s["batch"], device=device)
    splits = -(-s["context"] // FIXED_PIECE)
    out = bi.decode_attention_fixed(q, kb, vb, table, rows, lens, 0.08, FIXED_PIECE, splits)
    r = s["batch"] // 2 + 1
    alone = bi.decode_attention_fixed(q[r:r + 1], kb, vb, table, rows[r:r + 1], lens[r:r + 1], 0.08, FIXED_PIECE)
    report("determ", f"decode_attention_fixed: request alone vs among {s['batch']}", _same(alone[0], out[r]))
    pick = torch.tensor([s["batch"] - 1, 0, r, 1], device=device)
    some = bi.decode_attention_fixed(q[pick], kb, vb, table, rows[pick], lens[pick], 0.08, FIXED_PIECE, splits)
    report("determ", "decode_attention_fixed: the request third of 4", _same(some[2], out[r]))

    new = s["new"]
    prefix = int(lens[0]) - new
    qe = torch.randn(new, q.shape[1], q.shape[2], generator=g).to(dt).to(device)
    t = lambda *v: torch.tensor(v, device=device)  # noqa: E731
    one = bi.extend_attention_fixed(qe, kb, vb, table, rows[:1], t(prefix), t(new), 0.08, FIXED_PIECE)
    cut = new // 2 + 7
    a = bi.extend_attention_fixed(qe[:cut], kb, vb, table, rows[:1], t(prefix), t(cut), 0.08, FIXED_PIECE)
    b = bi.extend_attention_fixed(qe[cut:], kb, vb, table, rows[:1], t(prefix + cut), t(new - cut), 0.08,
                                  FIXED_PIECE)
    report("determ", "extend_attention_fixed: one extend vs two chunks", _same(torch.cat([a, b]), one))
    dec = torch.stack([bi.decode_attention_fixed(qe[j:j + 1], kb, vb, table, rows[:1], t(prefix + j + 1), 0.08,
                                                 FIXED_PIECE)[0] for j in (0, cut, new - 1)])
    report("determ", "extend_attention_fixed: tokens vs decode at their positions",
           _same(dec, one[[0, cut, new - 1]]))


def _attention_shapes(smoke: bool) -> dict:
    if smoke:
        return dict(batch=4, context=200, new=40, q_heads=4, kv_heads=2, head_dim=16)
    return dict(batch=32, context=4096, new=1024, q_heads=32, kv_heads=8, head_dim=128)


def _pool(s: dict, device, dt, g):
    """q (B, Hq, D), a pool of B requests of up to `context` tokens in shuffled slots, their lengths."""
    import torch

    b, ctx = s["batch"], s["context"]
    slots = torch.randperm(b * ctx, generator=g).view(b, ctx) + 1
    kb = torch.randn(b * ctx + 1, s["kv_heads"], s["head_dim"], generator=g).to(dt).to(device)
    vb = torch.randn(b * ctx + 1, s["kv_heads"], s["head_dim"], generator=g).to(dt).to(device)
    lens = ctx - torch.randint(0, ctx // 4, (b,), generator=g)
    lens[0] = ctx
    q = torch.randn(b, s["q_heads"], s["head_dim"], generator=g).to(dt).to(device)
    return q, kb, vb, slots.to(device), lens.to(device)


def kernel_timings(device, smoke: bool, timeit: Callable, report: Callable) -> None:
    import torch

    from radixgen.kernels import batch_invariant as bi
    from radixgen.kernels import decode_attention, extend_attention
    from radixgen.kernels.cpu import FIXED_PIECE

    g = torch.Generator().manual_seed(1)
    dt = torch.float32 if smoke else torch.bfloat16
    k, n = (64, 96) if smoke else (4096, 14336)
    w = (torch.randn(n, k, generator=g) / k ** 0.5).to(dt).to(device)
    for m in (1, 8) if smoke else (1, 32, 512):
        x = torch.randn(m, k, generator=g).to(dt).to(device)
        fixed, dense = timeit(lambda x=x: bi.fixed_matmul(x, w)), timeit(lambda x=x: x @ w.t())
        report("determ", f"matmul {m}x{k}x{n}: fixed_matmul / cuBLAS",
               f"{fixed:8.3f} / {dense:8.3f} ms  ({fixed / dense:.2f}x)")
    s = _attention_shapes(smoke)
    q, kb, vb, table, lens = _pool(s, device, dt, g)
    rows = torch.arange(s["batch"], device=device)
    splits = -(-s["context"] // FIXED_PIECE)
    for b in (1, s["batch"]):
        fixed = timeit(lambda b=b: bi.decode_attention_fixed(q[:b], kb, vb, table, rows[:b], lens[:b], 0.08,
                                                             FIXED_PIECE, splits))
        default = timeit(lambda b=b: decode_attention(q[:b], kb, vb, table, rows[:b], lens[:b], 0.08))
        report("determ", f"decode attention batch {b}, ~{s['context']} ctx: fixed pieces / default",
               f"{fixed:8.3f} / {default:8.3f} ms  ({fixed / default:.2f}x)")
    new, b = (16, 2) if smoke else (s["new"], 4)
    qe = torch.randn(b * new, s["q_heads"], s["head_dim"], generator=g).to(dt).to(device)
    pre = torch.full((b,), s["context"] - new, device=device)
    ext = torch.full((b,), new, device=device)
    fixed = timeit(lambda: bi.extend_attention_fixed(qe, kb, vb, table, rows[:b], pre, ext, 0.08, FIXED_PIECE,
                                                     splits))
    default = timeit(lambda: extend_attention(qe, kb, vb, table, rows[:b], pre, ext, 0.08))
    report("determ", f"extend attention {b} x {new} new after {s['context'] - new}: as decode / default",
           f"{fixed:8.3f} / {default:8.3f} ms  ({fixed / default:.2f}x)")


def engine_identity(cfg_dir: Path, cfg: dict, device: str, dtype: str, smoke: bool, report: Callable) -> None:
    """The deterministic Engine: a greedy and a seeded request alone, from the cache, and among 7 others."""
    from radixgen.runtime.engine import Engine

    rng = random.Random(3)
    plen = 16 if smoke else 96
    prompts = [[rng.randrange(3, cfg["vocab_size"]) for _ in range(plen + 5 * i)] for i in range(8)]
    greedy = {"max_new_tokens": 8 if smoke else 32, "temperature": 0}
    seeded = {**greedy, "temperature": 0.8, "top_p": 0.9, "top_k": 50, "seed": 5}
    eng = Engine(model=str(cfg_dir), load_format="dummy", dtype=dtype, device=device, deterministic=True,
                 disable_cuda_graph=True, max_total_tokens=8 * 400, max_running_requests=8)
    try:
        def run(ids, params):
            outs = eng.generate(input_ids=ids, sampling_params=params, return_logprob=True)
            return [(o["output_ids"], o["meta_info"].get("output_token_logprobs")) for o in outs]

        for name, params in (("greedy", greedy), ("seeded top-p", seeded)):
            alone = run(prompts[:1], params)[0]
            cached = run(prompts[:1], params)[0]  # the prompt now a radix-cache hit
            mixed = run(prompts[1:4] + prompts[:1] + prompts[4:], params)[3]
            verdict = "identical" if alone == cached == mixed else \
                f"DIFFERS (cache {alone == cached}, batch {alone == mixed})"
            report("determ", f"engine {name}: ids + logprobs alone / cached / in 8", verdict)
    finally:
        eng.shutdown()


def bench_deterministic(cfg: dict, device, dtype: str, smoke: bool, timeit: Callable, report: Callable,
                        engine_steps: Callable, write_model_dir: Callable, graph_step: float | None) -> None:
    """All three parts; engine_steps is gpu_check.engine_decode_steps, graph_step the default Engine's batch-1
    decode step with CUDA graphs where gpu_check.py measured it."""
    kernel_identity(device, smoke, report)
    kernel_timings(device, smoke, timeit, report)
    with tempfile.TemporaryDirectory(prefix="radixgen-gpucheck-det-") as tmp:
        cfg_dir = write_model_dir(Path(tmp) / "model", cfg)
        engine_identity(cfg_dir, cfg, device.type, dtype, smoke, report)
        batches, prompt_len, new_tokens = ([1, 4], 8, 4) if smoke else ([1, 8], 128, 48)
        steps: dict[str, dict[int, float]] = {"det": {}, "eager": {}}
        for kind, opts in (("det", {"deterministic": True}), ("eager", {})):
            engine_steps(cfg_dir, cfg, device.type, dtype, batches, prompt_len, new_tokens,
                         lambda b, step, kind=kind: steps[kind].__setitem__(b, step),
                         {"disable_cuda_graph": True, **opts}, f"{kind} ")
        for b in batches:
            det, eager = steps["det"].get(b), steps["eager"].get(b)
            if det and eager:
                line = f"{b / det:8.1f} / {b / eager:8.1f} tok/s  ({det / eager:.2f}x the step time)"
                if b == 1 and graph_step:
                    line += f"; with graphs {1 / graph_step:.1f} tok/s ({det / graph_step:.2f}x)"
                report("determ", f"decode batch {b}: deterministic / default (eager)", line)
