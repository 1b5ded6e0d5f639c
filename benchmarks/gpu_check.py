"""GPU check, part 2 (gpu_check.sh runs the kernel tests first): kernel timings and engine decode throughput.

1. decode_attention / extend_attention against torch's scaled_dot_product_attention on the same data
   (Llama-3-8B head shapes, bf16, 32 requests x 4096-token contexts), with their relative difference.
2. The ceilings of this GPU, measured here: device-to-device copy bandwidth and bf16 matmul throughput.
3. The Engine on a dummy-weight Llama-3-8B-shaped model: decode tokens/s at batch 1, 32 and 128 with decode
   steps replayed from CUDA graphs (the default), the fraction of the copy bandwidth (batch 1) and of the
   matmul ceiling (batch 128) that decoding achieves, and how many decode steps replayed a graph. Then batch 1
   again on an Engine with disable_cuda_graph=True (eager decode) and the graphs' speed-up over it.
   A decode step's time = (time of a run with N new tokens - time of a prefill-only run) / (N - 1).

4. Tensor parallelism, where the machine has two GPUs or more (tp 2, and tp 4 with four): greedy tokens of tp N
   against tp 1 on the same random checkpoint (a small Llama, so both load identical weights; bf16 partial sums
   may flip a near-tie, so the agreement is reported, not required), then decode tokens/s of the
   Llama-3-8B-shaped dummy model at tp N beside tp 1 (dummy weights are drawn per rank: speed only).

5. The deterministic mode (gpu_check_det.py): the batch-invariant Triton kernels' identity on the device, their
   timings against the default kernels, the deterministic Engine's identity and decode speed against the default.
   --deterministic-only runs this part alone.

--cpu-smoke runs the same code paths on tiny shapes on the CPU (Triton interpreted; tp 2 on gloo) to check the
script.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import signal
import statistics
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

LLAMA3_8B = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "vocab_size": 128256,
    "max_position_embeddings": 8192,
    "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0,
    "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                     "original_max_position_embeddings": 8192},
    "tie_word_embeddings": False,
    "bos_token_id": 128000,
    "eos_token_id": 128001,
    "hidden_act": "silu",
    "torch_dtype": "bfloat16",
}
TINY = {**LLAMA3_8B, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 512,
        "max_position_embeddings": 512, "bos_token_id": 1, "eos_token_id": 2,
        "rope_scaling": {**LLAMA3_8B["rope_scaling"], "original_max_position_embeddings": 256}}


class Shapes(NamedTuple):
    batch: int
    context: int  # decode: tokens per request; extend: prefix + new tokens
    new_tokens: int  # extend: new tokens per request
    prefill_batch: int  # the no-prefix prefill case: requests of `context` tokens
    q_heads: int
    kv_heads: int
    head_dim: int


FULL = Shapes(batch=32, context=4096, new_tokens=1024, prefill_batch=8, q_heads=32, kv_heads=8, head_dim=128)
SMOKE = Shapes(batch=2, context=40, new_tokens=16, prefill_batch=2, q_heads=6, kv_heads=2, head_dim=16)


class Row(NamedTuple):
    section: str
    name: str
    value: str


ROWS: list[Row] = []
DEADLINE = [math.inf]  # time.monotonic() after which no part starts (and SIGALRM stops the running one)


def report(section: str, name: str, value: str) -> None:
    ROWS.append(Row(section, name, value))
    print(f"  {section:8s} {name:52s} {value}", flush=True)


# ------------------------------------------------------------------------------------------- timing


def make_timer(device) -> Callable[[Callable[[], object]], float]:
    """fn -> milliseconds per call."""
    if device.type == "cuda":
        import triton.testing

        return lambda fn: float(triton.testing.do_bench(fn, warmup=10, rep=50))

    def cpu_time(fn) -> float:
        fn()  # the interpreter's first call includes its own set-up
        samples = []
        for _ in range(2):
            start = time.perf_counter()
            fn()
            samples.append(time.perf_counter() - start)
        return 1e3 * statistics.median(samples)

    return cpu_time


def rel_diff(out, ref) -> float:
    return ((out.double() - ref.double()).norm() / ref.double().norm()).item()


# ------------------------------------------------------------------------------------------- kernels


class Paged(NamedTuple):
    """A KV pool holding `batch` requests of `context` tokens each, in shuffled slots."""

    k_buffer: object  # (num_slots, Hkv, D)
    v_buffer: object
    req_to_slot: object  # (B, L)
    rows: object  # (B,)

    def dense(self, batch: int):
        """K and V of the first `batch` requests gathered to (b, Hkv, L, D), the layout SDPA wants."""
        table = self.req_to_slot[:batch]
        return (self.k_buffer[table].transpose(1, 2).contiguous(),
                self.v_buffer[table].transpose(1, 2).contiguous())


def make_pool(s: Shapes, device, dtype, g) -> Paged:
    import torch

    num_slots = s.batch * s.context + 1  # slot 0 is the padding slot
    shape = (num_slots, s.kv_heads, s.head_dim)
    k_buffer = torch.randn(shape, device=device, dtype=dtype, generator=g)
    v_buffer = torch.randn(shape, device=device, dtype=dtype, generator=g)
    slots = torch.randperm(num_slots - 1, device=device, generator=g) + 1  # scattered like a used pool
    return Paged(k_buffer, v_buffer, slots.view(s.batch, s.context), torch.arange(s.batch, device=device))


def bench_decode(s: Shapes, pool: Paged, g, timeit) -> None:
    """One new token per request attending to all `context` positions."""
    import torch
    import torch.nn.functional as F

    from radixgen.kernels import decode_attention

    scale = s.head_dim**-0.5
    kb, vb, table, rows = pool
    q = torch.randn(s.batch, s.q_heads, s.head_dim, device=kb.device, dtype=kb.dtype, generator=g)
    seq_lens = torch.full((s.batch,), s.context, device=kb.device)
    k_dense, v_dense = pool.dense(s.batch)
    kv_bytes = 2 * k_dense.numel() * k_dense.element_size()
    ours = lambda: decode_attention(q, kb, vb, table, rows, seq_lens, scale)
    dense = lambda: F.scaled_dot_product_attention(q.unsqueeze(2), k_dense, v_dense, scale=scale,
                                                   enable_gqa=True).squeeze(2)

    def gather_dense():  # what a runtime without paged kernels does every step: gather, then SDPA
        k, v = kb[table].transpose(1, 2), vb[table].transpose(1, 2)
        return F.scaled_dot_product_attention(q.unsqueeze(2), k, v, scale=scale, enable_gqa=True).squeeze(2)

    title = f"decode B={s.batch} L={s.context}"
    t_ours, t_dense = timeit(ours), timeit(dense)
    report("kernel", f"{title} triton paged", f"{t_ours:8.3f} ms  {kv_bytes / t_ours / 1e6:7.0f} GB/s")
    report("kernel", f"{title} sdpa on dense K/V", f"{t_dense:8.3f} ms  {kv_bytes / t_dense / 1e6:7.0f} GB/s")
    report("kernel", f"{title} gather + sdpa", f"{timeit(gather_dense):8.3f} ms")
    report("kernel", f"{title} rel diff vs sdpa", f"{rel_diff(ours(), dense()):.2e}")


def bench_extend(s: Shapes, pool: Paged, g, timeit) -> None:
    """`new_tokens` per request after a prefix of context - new_tokens; all their K/V already pooled."""
    import torch
    import torch.nn.functional as F

    from radixgen.kernels import extend_attention

    scale, group = s.head_dim**-0.5, s.q_heads // s.kv_heads
    kb, vb, table, rows = pool
    prefix, new = s.context - s.new_tokens, s.new_tokens
    q = torch.randn(s.batch * new, s.q_heads, s.head_dim, device=kb.device, dtype=kb.dtype, generator=g)
    prefix_lens = torch.full((s.batch,), prefix, device=kb.device)
    extend_lens = torch.full((s.batch,), new, device=kb.device)
    q_dense = q.view(s.batch, new, s.q_heads, s.head_dim).transpose(1, 2)  # (B, H, E, D)
    k_dense, v_dense = (t.repeat_interleave(group, 1) for t in pool.dense(s.batch))  # (B, H, L, D)
    positions = torch.arange(s.context, device=kb.device)
    mask = positions[None, :] <= positions[prefix:, None]  # (E, L): prefix + causal
    ours = lambda: extend_attention(q, kb, vb, table, rows, prefix_lens, extend_lens, scale)
    # a boolean mask rules out the flash backend; K/V repeated per query head let the efficient one run
    dense = lambda: F.scaled_dot_product_attention(q_dense, k_dense, v_dense, attn_mask=mask, scale=scale)
    flops = 4 * s.batch * s.q_heads * s.head_dim * (new * prefix + new * (new + 1) / 2)
    title = f"extend B={s.batch} prefix={prefix} new={new}"
    t_ours, t_dense = timeit(ours), timeit(dense)
    report("kernel", f"{title} triton paged", f"{t_ours:8.3f} ms  {flops / t_ours / 1e9:7.1f} TFLOP/s")
    report("kernel", f"{title} sdpa masked dense", f"{t_dense:8.3f} ms  {flops / t_dense / 1e9:7.1f} TFLOP/s")
    out_dense = dense().transpose(1, 2).reshape(s.batch * new, s.q_heads, s.head_dim)
    report("kernel", f"{title} rel diff vs sdpa", f"{rel_diff(ours(), out_dense):.2e}")


def bench_prefill(s: Shapes, pool: Paged, g, timeit) -> None:
    """Plain prefill (no prefix) of prefill_batch requests: causal SDPA can use its flash backend."""
    import torch
    import torch.nn.functional as F

    from radixgen.kernels import extend_attention

    scale = s.head_dim**-0.5
    kb, vb, table, rows = pool
    b, n = s.prefill_batch, s.context
    q = torch.randn(b * n, s.q_heads, s.head_dim, device=kb.device, dtype=kb.dtype, generator=g)
    zeros = torch.zeros(b, device=kb.device, dtype=torch.int64)
    lens = torch.full((b,), n, device=kb.device)
    q_dense = q.view(b, n, s.q_heads, s.head_dim).transpose(1, 2)
    k_dense, v_dense = pool.dense(b)
    ours = lambda: extend_attention(q, kb, vb, table, rows[:b], zeros, lens, scale)
    dense = lambda: F.scaled_dot_product_attention(q_dense, k_dense, v_dense, is_causal=True, scale=scale,
                                                   enable_gqa=True)
    flops = 4 * b * s.q_heads * s.head_dim * n * (n + 1) / 2
    title = f"prefill B={b} L={n}"
    t_ours, t_dense = timeit(ours), timeit(dense)
    report("kernel", f"{title} triton paged", f"{t_ours:8.3f} ms  {flops / t_ours / 1e9:7.1f} TFLOP/s")
    report("kernel", f"{title} sdpa causal dense", f"{t_dense:8.3f} ms  {flops / t_dense / 1e9:7.1f} TFLOP/s")
    out_dense = dense().transpose(1, 2).reshape(b * n, s.q_heads, s.head_dim)
    report("kernel", f"{title} rel diff vs sdpa", f"{rel_diff(ours(), out_dense):.2e}")


def bench_kernels(s: Shapes, device, dtype, timeit) -> None:
    import torch

    g = torch.Generator(device=device).manual_seed(0)
    pool = make_pool(s, device, dtype, g)
    for bench in (bench_decode, bench_extend, bench_prefill):
        bench(s, pool, g, timeit)  # each frees its dense copies when it returns


# ------------------------------------------------------------------------------------------- ceilings


class Ceilings(NamedTuple):
    bandwidth: float  # bytes/s, device-to-device copy (read + write)
    matmul: float  # FLOP/s, bf16 matmul


def measure_ceilings(device, smoke: bool, timeit) -> Ceilings:
    import torch

    copy_bytes = (1 << 20) if smoke else (4 << 30)
    src = torch.empty(copy_bytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    bandwidth = 2 * copy_bytes / (timeit(lambda: dst.copy_(src)) / 1e3)  # each byte is read and written
    n = 256 if smoke else 8192
    x = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    y = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    matmul = 2 * n**3 / (timeit(lambda: x @ y) / 1e3)
    report("ceiling", f"copy bandwidth ({copy_bytes >> 20} MiB d2d)", f"{bandwidth / 1e9:8.0f} GB/s")
    report("ceiling", f"bf16 matmul peak ({n}^3)", f"{matmul / 1e12:8.1f} TFLOP/s")
    return Ceilings(bandwidth, matmul)


# ------------------------------------------------------------------------------------------- engine


def write_model_dir(folder: Path, config: dict) -> Path:
    """config.json plus a word-level tokenizer over the whole vocabulary (no hub access needed)."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config, indent=1))
    vocab = {f"w{i}": i for i in range(config["vocab_size"])}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="w0"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.save(str(folder / "tokenizer.json"))
    bos, eos = config["bos_token_id"], config["eos_token_id"]
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": f"w{bos}", "eos_token": f"w{eos}",
        "unk_token": "w0", "model_max_length": config["max_position_embeddings"],
    }))
    return folder


def step_costs(cfg: dict, batch: int, context: float) -> tuple[float, float]:
    """(bytes read, FLOPs) of one decode step: every weight once (bf16), the KV of `context` tokens, and the
    matmuls' plus attention's FLOPs. The embedding table is not counted: a step reads `batch` rows of it."""
    h, inter, layers = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"]
    q_dim = cfg["num_attention_heads"] * cfg["head_dim"]
    kv_dim = cfg["num_key_value_heads"] * cfg["head_dim"]
    matmul_params = layers * (h * q_dim + 2 * h * kv_dim + q_dim * h + 3 * h * inter) + cfg["vocab_size"] * h
    weight_bytes = 2 * (matmul_params + layers * 2 * h + h)
    kv_bytes = 2 * batch * context * layers * 2 * kv_dim
    flops = 2 * batch * matmul_params + 4 * batch * context * layers * q_dim
    return weight_bytes + kv_bytes, flops


def engine_decode_steps(cfg_dir: Path, cfg: dict, device: str, dtype: str, batches: list[int],
                        prompt_len: int, new_tokens: int, on_step: Callable[[int, float], None],
                        options: dict | None = None, label: str = "") -> dict:
    """Calls on_step(batch, seconds per decode step) as soon as each batch size is measured; `options` are
    further Engine options. Returns the Engine's CUDA-graph info (server info) after the runs."""
    rng = random.Random(0)

    def prompts(batch: int) -> list[list[int]]:  # fresh random ids each call: no prefix-cache hits
        return [[rng.randrange(3, cfg["vocab_size"]) for _ in range(prompt_len)] for _ in range(batch)]

    # ENGINE-API: the only place that knows the Engine's constructor, generate() and shutdown().
    from radixgen.runtime.engine import Engine

    biggest = max(batches)
    start = time.perf_counter()
    eng = Engine(model=str(cfg_dir), load_format="dummy", dtype=dtype, device=device,
                 max_total_tokens=2 * biggest * (prompt_len + new_tokens) + 64,
                 max_running_requests=biggest, max_prefill_tokens=biggest * prompt_len,
                 chunked_prefill_size=biggest * prompt_len, **(options or {}))
    what = "model load" if (options or {}).get("disable_cuda_graph") else "model load, CUDA graph capture"
    report("engine", f"{label}engine start ({what})", f"{time.perf_counter() - start:6.1f} s")

    def generate(batch: int, max_new: int) -> float:
        start = time.perf_counter()
        outs = eng.generate(input_ids=prompts(batch), sampling_params={
            "max_new_tokens": max_new, "ignore_eos": True, "temperature": 0})
        elapsed = time.perf_counter() - start
        got = [len(o["output_ids"]) for o in outs]
        if got != [max_new] * batch:
            raise RuntimeError(f"asked {max_new} new tokens per request, got {sorted(set(got))}")
        return elapsed

    try:
        for batch in batches:
            generate(batch, 4)  # warm-up: kernel compilation, allocator growth
            prefill_only = generate(batch, 1)
            full = generate(batch, new_tokens)
            report("engine", f"{label}batch {batch}: prefill-only run / full run",
                   f"{prefill_only:6.2f} s / {full:6.2f} s")
            if full - prefill_only <= 0.05 * full:  # tiny smoke shapes: the decode steps drown in noise
                report("engine", f"{label}decode batch {batch}", "n/a (decode time within run-to-run noise)")
                continue
            on_step(batch, (full - prefill_only) / (new_tokens - 1))
        return eng.get_server_info().get("cuda_graph", {})
    finally:
        eng.shutdown()


def bench_engine(cfg: dict, device: str, dtype: str, batches: list[int], prompt_len: int, new_tokens: int,
                 ceilings: Ceilings, steps: dict[str, dict[int, float]], eager: bool = False) -> None:
    """eager: the same on an Engine with disable_cuda_graph=True. Seconds per decode step go into
    steps["graph" or "eager"][batch]."""
    context = prompt_len + new_tokens / 2  # the average context during the decode steps
    kind = "eager" if eager else "graph"
    label = "eager (disable_cuda_graph) " if eager else ""
    measured = steps.setdefault(kind, {})

    def on_step(batch: int, step: float) -> None:
        measured[batch] = step
        report("engine", f"{label}decode batch {batch}", f"{batch / step:8.1f} tok/s  ({1e3 * step:.2f} ms/step)")
        nbytes, flops = step_costs(cfg, batch, context)
        if batch == min(batches):  # small batches are bound by reading the weights
            report("engine", f"{label}batch {batch}: fraction of copy bandwidth",
                   f"{nbytes / step / ceilings.bandwidth:8.1%}")
        if batch == max(batches) and not eager:  # large batches by the matmuls
            report("engine", f"batch {batch}: fraction of bf16 matmul peak",
                   f"{flops / step / ceilings.matmul:8.1%}")
        other = steps.get("eager" if not eager else "graph", {}).get(batch)
        if other is not None:
            graph_step, eager_step = (other, step) if eager else (step, other)
            report("engine", f"batch {batch}: cuda graph speed-up over eager", f"{eager_step / graph_step:8.2f} x")

    options = {"disable_cuda_graph": True} if eager else {}
    with tempfile.TemporaryDirectory(prefix="radixgen-gpucheck-") as tmp:
        cfg_dir = write_model_dir(Path(tmp) / "model", cfg)
        info = engine_decode_steps(cfg_dir, cfg, device, dtype, batches, prompt_len, new_tokens, on_step,
                                   options, label)
    if info.get("enabled"):
        buckets = info.get("buckets") or [0]
        report("engine", f"{label}cuda graph decode replays (buckets 1..{buckets[-1]})",
               f"{info.get('replays', 0):8d}  ({len(buckets)} graphs)")
    else:
        report("engine", f"{label}cuda graphs", "    off")


# ------------------------------------------------------------------------------------------- tensor parallelism

MID = {**LLAMA3_8B, "hidden_size": 1024, "intermediate_size": 2816, "num_hidden_layers": 4,
       "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 64, "vocab_size": 32000,
       "bos_token_id": 1, "eos_token_id": 2}


def write_checkpoint(folder: Path, config: dict, dtype: str) -> Path:
    """write_model_dir plus random weights in safetensors (transformers' model of the config, seeded)."""
    import torch
    import transformers

    write_model_dir(folder, config)
    torch.manual_seed(0)
    hf = transformers.LlamaConfig(**{k: v for k, v in config.items() if k not in ("architectures", "model_type")})
    model = transformers.LlamaForCausalLM(hf).to(getattr(torch, dtype))
    model.save_pretrained(str(folder), safe_serialization=True)
    (folder / "config.json").write_text(json.dumps(config, indent=1))  # ours, as write_model_dir wrote it
    return folder


def bench_tp(device: str, dtype: str, tp: int, smoke: bool, new_tokens: int) -> None:
    from radixgen.runtime.engine import Engine

    cfg = TINY if smoke else MID
    rng = random.Random(1)
    prompts = [[rng.randrange(3, cfg["vocab_size"]) for _ in range(16)] for _ in range(8)]
    params = {"max_new_tokens": 16, "temperature": 0, "ignore_eos": True}
    outs = {}
    with tempfile.TemporaryDirectory(prefix="radixgen-gpucheck-tp-") as tmp:
        folder = write_checkpoint(Path(tmp) / "model", cfg, dtype)
        for size in (1, tp):
            with Engine(model=str(folder), dtype=dtype, device=device, tp_size=size, max_total_tokens=4096) as eng:
                outs[size] = [o["output_ids"] for o in eng.generate(input_ids=prompts, sampling_params=params)]
    same = sum(a == b for a, b in zip(outs[1], outs[tp], strict=True))
    tokens = sum(x == y for a, b in zip(outs[1], outs[tp], strict=True) for x, y in zip(a, b, strict=True))
    report("tp", f"tp {tp} greedy vs tp 1 ({cfg['num_hidden_layers']}-layer random checkpoint, {dtype})",
           f"{same}/{len(prompts)} sequences, {tokens}/{16 * len(prompts)} tokens identical")
    big = TINY if smoke else LLAMA3_8B
    batches = [1, 4] if smoke else [1, 32]
    prompt_len = 8 if smoke else 128
    steps: dict[int, dict[int, float]] = {1: {}, tp: {}}
    with tempfile.TemporaryDirectory(prefix="radixgen-gpucheck-tp-") as tmp:
        cfg_dir = write_model_dir(Path(tmp) / "model", big)
        for size in (1, tp):
            label = f"tp {size} "

            def on_step(batch: int, step: float, size=size, label=label) -> None:
                steps[size][batch] = step
                report("tp", f"{label}decode batch {batch}", f"{batch / step:8.1f} tok/s  ({1e3 * step:.2f} ms/step)")
                if size != 1 and batch in steps[1]:
                    report("tp", f"tp {size} speed-up over tp 1 at batch {batch}", f"{steps[1][batch] / step:8.2f} x")

            engine_decode_steps(cfg_dir, big, device, dtype, batches, prompt_len, new_tokens, on_step,
                                {"tp_size": size}, label)


# ------------------------------------------------------------------------------------------- main


def _out_of_time(signum, frame) -> None:
    raise TimeoutError("the --deadline-s budget ran out")


def run_part(name: str, fn: Callable[[], None]) -> bool:
    print(f"== {name}", flush=True)
    if time.monotonic() > DEADLINE[0]:
        report(name, "SKIPPED", "out of time")
        return False
    start = time.perf_counter()
    try:
        fn()
    except Exception as exc:  # noqa: BLE001 - one failed part must not hide the others' figures
        traceback.print_exc()
        first_line = (str(exc).splitlines() or [""])[0]
        report(name, "FAILED", f"{type(exc).__name__}: {first_line[:120]}")
        return False
    print(f"   ({time.perf_counter() - start:.1f} s)", flush=True)
    return True


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cpu-smoke", action="store_true", help="tiny shapes on the CPU, Triton interpreted")
    parser.add_argument("--skip-engine", action="store_true")
    parser.add_argument("--new-tokens", type=int, default=64, help="decode tokens per request (engine part)")
    parser.add_argument("--kernel-tests", default="", help="the kernel tests' summary, for the final table")
    parser.add_argument("--deterministic-only", action="store_true", help="only the deterministic mode's part")
    parser.add_argument("--deadline-s", type=int, default=0,
                        help="stop the part running after this many seconds and still print the table")
    args = parser.parse_args()
    if args.deadline_s > 0:
        DEADLINE[0] = time.monotonic() + args.deadline_s
        signal.signal(signal.SIGALRM, _out_of_time)
        signal.alarm(args.deadline_s)
    if args.cpu_smoke:
        os.environ["TRITON_INTERPRET"] = "1"  # before the first kernel launch imports triton

    import torch

    if not args.cpu_smoke and not torch.cuda.is_available():
        print("no CUDA device: run with --cpu-smoke for the CPU check", file=sys.stderr)
        return 2
    if args.kernel_tests:
        report("tests", "tests/kernels", args.kernel_tests)
    device = torch.device("cpu" if args.cpu_smoke else "cuda")
    name = "cpu (smoke)" if args.cpu_smoke else torch.cuda.get_device_name(device)
    import triton

    print(f"device {name}; torch {torch.__version__}; triton {triton.__version__}", flush=True)
    timeit = make_timer(device)
    shapes = SMOKE if args.cpu_smoke else FULL
    if args.deterministic_only:
        return print_table(name, run_part("determ", lambda: run_deterministic(args.cpu_smoke, device, timeit, None)))
    kernel_dtype = torch.float32 if args.cpu_smoke else torch.bfloat16
    ok = run_part("kernel", lambda: bench_kernels(shapes, device, kernel_dtype, timeit))
    if not args.cpu_smoke:
        torch.cuda.empty_cache()  # hand the benchmark's buffers back before the engine's process starts
    ceilings: list[Ceilings] = []
    ok &= run_part("ceiling", lambda: ceilings.append(measure_ceilings(device, args.cpu_smoke, timeit)))
    if not args.skip_engine and ceilings:
        cfg, dtype = (TINY, "float32") if args.cpu_smoke else (LLAMA3_8B, "bfloat16")
        batches = [1, 4] if args.cpu_smoke else [1, 32, 128]
        new_tokens = 4 if args.cpu_smoke else args.new_tokens
        prompt_len = 8 if args.cpu_smoke else 128
        steps: dict[str, dict[int, float]] = {}
        engine = lambda: bench_engine(cfg, device.type, dtype, batches, prompt_len, new_tokens, ceilings[0], steps)
        ok &= run_part("engine", engine)
        # batch 1 once more with eager decode steps, for the graphs' speed-up
        eager = lambda: bench_engine(cfg, device.type, dtype, batches[:1], prompt_len, new_tokens, ceilings[0],
                                     steps, eager=True)
        ok &= run_part("engine-eager", eager)
    graph_step = None if args.skip_engine or not ceilings else steps.get("graph", {}).get(1)
    ok &= run_part("determ", lambda: run_deterministic(args.cpu_smoke, device, timeit, graph_step))
    gpus = 2 if args.cpu_smoke else torch.cuda.device_count()
    if gpus < 2:
        report("tp", "tensor parallelism", "skipped: this machine has one GPU")
    else:
        dtype = "float32" if args.cpu_smoke else "bfloat16"
        for tp in [t for t in (2, 4) if t <= gpus]:
            ok &= run_part(f"tp{tp}", lambda tp=tp: bench_tp(device.type, dtype, tp, args.cpu_smoke,
                                                              4 if args.cpu_smoke else args.new_tokens))

    return print_table(name, ok)


def run_deterministic(smoke: bool, device, timeit, graph_step: float | None) -> None:
    """Part 5 (gpu_check_det.py, beside this file); graph_step: the default Engine's batch-1 step with graphs."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from gpu_check_det import bench_deterministic

    cfg = TINY if smoke else LLAMA3_8B
    bench_deterministic(cfg, device, "bfloat16", smoke, timeit, report, engine_decode_steps, write_model_dir,
                        graph_step)


def print_table(name: str, ok: bool) -> int:
    width = max(len(r.name) for r in ROWS) if ROWS else 10
    print(f"\n=== radixgen GPU check: {name} ===")
    for r in ROWS:
        print(f"{r.section:8s} | {r.name:{width}s} | {r.value}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
