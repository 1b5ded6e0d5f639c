"""kv_cache_dtype (auto | int8 | fp8_e4m3): the option and its errors, the pool's layout and capacity at equal
memory, the model over an 8-bit pool on every path (the C kernels, the fused decode step, plain torch, Triton
under the interpreter) against the same model over the bf16 / float32 pool within a stated tolerance, and the
radix tree, chunked prefill and the idle invariant through the Engine.

Tolerances (tiny random models, tests/tiny_models.py, whose weights are larger than a trained model's): the
logits over an int8 pool within 3% of the 16-bit pool's (relative L2), fp8 e4m3 (3 mantissa bits) within 8%;
one path against another over the same 8-bit pool as close as over the 16-bit pool."""

from __future__ import annotations

import pytest
import torch
from kv_helpers import kv_of
from tiny_models import tiny_model_dir

from radixgen.common.flags import add_dataclass_flags
from radixgen.kernels import cpu
from radixgen.runtime.config import RuntimeConfig
from radixgen.runtime.executor.model_runner import ForwardInput, ModelRunner
from radixgen.runtime.ground.kv_pool import KVPool

QUANT = ["int8", "fp8_e4m3"]
VS_16BIT = {"int8": 0.03, "fp8_e4m3": 0.08}
FUSED = cpu.available() and cpu.lib().has_decode_step


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def runner(arch: str = "llama-hd64", kv: str = "auto", dtype: str = "bfloat16", ops=None, **kw) -> ModelRunner:
    return ModelRunner(RuntimeConfig(model=str(tiny_model_dir(arch)), dtype=dtype, max_total_tokens=1024,
                                     max_running_requests=6, kv_cache_dtype=kv, **kw), ops=ops)


def drive(r: ModelRunner, prompts: list[list[int]], steps: int = 4, chunks: int = 1) -> torch.Tensor:
    """Prefill the prompts (in `chunks` extend steps, slots scattered), then decode steps of forced tokens; the
    logits of every prompt position (prompt by prompt) and of every decode step, concatenated."""
    free = kv_of(r).allocator.allocate(kv_of(r).allocator.available())
    kv_of(r).allocator.free(free[torch.randperm(free.numel(), generator=torch.Generator().manual_seed(0))])
    rows = [kv_of(r).table.allocate() for _ in prompts]
    lens, per_prompt, out = [0] * len(prompts), [[] for _ in prompts], []
    for c in range(chunks):
        parts = [p[len(p) * c // chunks:len(p) * (c + 1) // chunks] for p in prompts]
        ids, pos, slots = [], [], []
        for i, part in enumerate(parts):
            s = kv_of(r).allocator.allocate(len(part))
            kv_of(r).table.write(rows[i], lens[i], s)
            ids += part
            pos += range(lens[i], lens[i] + len(part))
            slots.append(s)
        ext = [len(p) for p in parts]
        logits = r.forward(ForwardInput(torch.tensor(ids), torch.tensor(pos), torch.cat(slots), torch.tensor(rows),
                                        list(lens), ext, torch.arange(len(ids))))
        for i, chunk in enumerate(logits.split(ext)):
            per_prompt[i].append(chunk)
        lens = [n + e for n, e in zip(lens, ext, strict=True)]
    out = [torch.cat(chunks) for chunks in per_prompt]
    for step in range(steps):
        s = kv_of(r).allocator.allocate(len(rows))
        for i, row in enumerate(rows):
            kv_of(r).table.write(row, lens[i], s[i:i + 1])
        out.append(r.forward(ForwardInput(torch.tensor([100 + step + i for i in range(len(rows))]), torch.tensor(lens),
                                          s, torch.tensor(rows), list(lens), [1] * len(rows),
                                          torch.arange(len(rows)))))
        lens = [n + 1 for n in lens]
    return torch.cat(out)


def prompts(lens=(7, 33, 20), seed: int = 1) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 49152, (n,), generator=gen).tolist() for n in lens]


def test_option_values_and_flag():
    assert RuntimeConfig().kv_cache_dtype == "auto" and RuntimeConfig().kv_code_dtype is None
    assert RuntimeConfig(kv_cache_dtype="int8").kv_code_dtype == torch.int8
    assert RuntimeConfig(kv_cache_dtype="fp8_e4m3").kv_code_dtype == torch.float8_e4m3fn
    for bad in ("int4", "fp8", "fp8_e5m2", "INT8", ""):
        with pytest.raises(ValueError, match="kv_cache_dtype must be one of auto, int8, fp8_e4m3"):
            RuntimeConfig(kv_cache_dtype=bad)
    import argparse

    parser = argparse.ArgumentParser()
    add_dataclass_flags(parser, RuntimeConfig)
    assert parser.parse_args(["--kv-cache-dtype", "int8"]).kv_cache_dtype == "int8"
    with pytest.raises(SystemExit):
        parser.parse_args(["--kv-cache-dtype", "int4"])


def test_engine_rejects_a_bad_kv_cache_dtype():
    from radixgen.runtime.engine import Engine

    with pytest.raises(ValueError, match="kv_cache_dtype must be one of"):
        Engine(model=str(tiny_model_dir("llama")), kv_cache_dtype="int4")


@pytest.mark.parametrize(("kv", "code"), [("int8", torch.int8), ("fp8_e4m3", torch.float8_e4m3fn)])
def test_pool_capacity_doubles_at_equal_memory(kv, code):
    """Sized from max_kv_memory_gb, the 8-bit pool holds 2D / (D + 2) times the tokens (its scales counted) in no
    more memory than the bf16 pool."""
    kw = dict(model=str(tiny_model_dir("llama-hd64")), dtype="bfloat16", max_kv_memory_gb=0.01)
    plain, quant = ModelRunner(RuntimeConfig(**kw)), ModelRunner(RuntimeConfig(**kw, kv_cache_dtype=kv))
    d = plain.model_config.head_dim
    p, q = plain.kv_pool, quant.kv_pool
    assert q.k_buffers[0].dtype == code and q.k_scales[0].dtype == torch.bfloat16
    assert q.k_scales[0].shape == q.k_buffers[0].shape[:2] and p.k_scales is None
    ratio = (q.num_slots - 1) / (p.num_slots - 1)
    assert ratio == pytest.approx(2 * d / (d + 2), rel=1e-3) and ratio > 1.9
    assert q.nbytes() <= 0.01 * 2**30 + KVPool.bytes_per_slot(2, 1, d, torch.bfloat16, code) and \
        p.nbytes() <= 0.01 * 2**30 + KVPool.bytes_per_slot(2, 1, d, torch.bfloat16)
    assert q.nbytes() == pytest.approx(p.nbytes(), rel=1e-3)
    info = quant.kv_cache_info()
    assert info["kv_cache_dtype"] == kv and info["capacity_tokens"] == q.num_slots - 1
    assert info["bytes_per_token"] == 2 * 2 * 1 * (d + 2) and info["memory_bytes"] == q.nbytes()


@pytest.mark.parametrize("kv", QUANT)
@pytest.mark.parametrize("path", ["c", "torch"])
@pytest.mark.parametrize("arch", ["llama-hd64", "qwen3"])  # head_dim 64 (C extend kernel), 16 (torch extend)
def test_logits_close_to_the_16bit_pool(arch, path, kv):
    """Prefill (C extend kernel or torch), decode (fused step or C decode attention, or torch) over the 8-bit pool:
    the logits of the same model over the bf16 pool within the stated tolerance, same argmax almost everywhere."""
    off = path == "torch"
    got = drive(runner(arch, kv, disable_cpu_kernels=off), prompts())
    want = drive(runner(arch, "auto", disable_cpu_kernels=off), prompts())
    assert rel(got, want) < VS_16BIT[kv]
    assert (got.argmax(-1) == want.argmax(-1)).float().mean() >= 0.8


@pytest.mark.parametrize("kv", QUANT)
@pytest.mark.parametrize("arch", ["llama-hd64", "llama"])
def test_c_kernels_match_the_torch_reference_over_the_8bit_pool(arch, kv):
    """float32: the C store, extend and decode attention over the 8-bit pool give the torch reference's logits
    (to the rare code that a last-bit difference in K/V rounds the other way)."""
    got = drive(runner(arch, kv, "float32"), prompts())
    want = drive(runner(arch, kv, "float32", disable_cpu_kernels=True), prompts())
    assert rel(got, want) < 5e-3


@pytest.mark.skipif(not FUSED, reason="the fused decode step needs AVX512-BF16")
@pytest.mark.parametrize("kv", QUANT)
def test_fused_decode_step_over_the_8bit_pool(kv):
    """The fused step quantizes and reads the pool as the unfused kernels do: same logits, same codes."""
    fused, plain = runner("llama-hd64", kv), runner("llama-hd64", kv)
    plain.fused_decode = None
    calls = []
    real = fused.fused_decode.__call__
    fd = fused.fused_decode
    fused.fused_decode = type("Counted", (), {"applies": fd.applies, "logits": fd.logits,
                                              "positions_fit": fd.positions_fit,
                                              "__call__": lambda self, *a: calls.append(1) or real(*a)})()
    got, want = drive(fused, prompts()), drive(plain, prompts())
    assert len(calls) == 4
    assert rel(got, want) < 1e-2 and (got.argmax(-1) == want.argmax(-1)).float().mean() >= 0.95
    for a, b in zip(fused.kv_pool.k_buffers + fused.kv_pool.k_scales, plain.kv_pool.k_buffers + plain.kv_pool.k_scales,
                    strict=True):
        assert (a.float() != b.float()).float().mean() < 0.01  # codes and scales: a few rounding flips at most


@pytest.mark.parametrize("kv", QUANT)
def test_chunked_prefill_reads_its_own_codes(kv):
    """A prompt prefilled in three chunks (each attending to the earlier chunks' codes in the pool) gives the
    logits of one prefill: a token's K/V are quantized alone, whatever else is in the step."""
    one = drive(runner("llama-hd64", kv, "float32"), prompts(), steps=0)
    three = drive(runner("llama-hd64", kv, "float32"), prompts(), steps=0, chunks=3)
    assert rel(three, one) < 2e-3 and (three.argmax(-1) == one.argmax(-1)).all()


def test_shared_prefix_is_what_recomputing_it_writes():
    """A prefix written by one request and read by another (through the table, as the radix tree shares it) gives
    the reader the logits of computing the prefix itself with the same quantization, bit for bit, and the codes
    and scales in the shared slots are the ones recomputing writes."""
    prefix, suffix = prompts((24, 9), seed=3)

    def run(shared: bool):
        r = runner("llama-hd64", "int8")
        kv = kv_of(r)
        a, b = kv.table.allocate(), kv.table.allocate()
        pre = kv.allocator.allocate(len(prefix))
        kv.table.write(a, 0, pre)
        r.forward(ForwardInput(torch.tensor(prefix), torch.arange(len(prefix)), pre, torch.tensor([a]), [0],
                               [len(prefix)], torch.tensor([len(prefix) - 1])))
        if shared:  # b reads a's slots
            kv.table.write(b, 0, pre)
        else:  # b computes the prefix itself, into slots of its own
            own = kv.allocator.allocate(len(prefix))
            kv.table.write(b, 0, own)
            r.forward(ForwardInput(torch.tensor(prefix), torch.arange(len(prefix)), own, torch.tensor([b]), [0],
                                   [len(prefix)], torch.tensor([len(prefix) - 1])))
            for bufs in (r.kv_pool.k_buffers, r.kv_pool.k_scales, r.kv_pool.v_buffers, r.kv_pool.v_scales):
                assert all(torch.equal(t[pre], t[own]) for t in bufs)
        s = kv.allocator.allocate(len(suffix))
        kv.table.write(b, len(prefix), s)
        return r.forward(ForwardInput(torch.tensor(suffix), torch.arange(len(prefix), len(prefix) + len(suffix)), s,
                                      torch.tensor([b]), [len(prefix)], [len(suffix)], torch.arange(len(suffix))))

    assert torch.equal(run(True), run(False))


@pytest.mark.parametrize("kv", QUANT)
def test_triton_path_over_the_8bit_pool(kv):
    """The CUDA path's wiring (Triton store, extend and decode under the interpreter) over an 8-bit pool gives the
    CPU runner's logits over the same pool (float32)."""
    pytest.importorskip("triton")
    from radixgen.runtime.layers.ops import TritonOps

    tr = runner("llama", kv, "float32", TritonOps())
    got = drive(tr, prompts((5, 12)), steps=2)
    want = drive(runner("llama", kv, "float32"), prompts((5, 12)), steps=2)
    assert rel(got, want) < 5e-3


@pytest.mark.parametrize("kv", QUANT)
def test_engine_radix_cache_and_idle_invariant(kv):
    """Through the Engine with an 8-bit pool: a second request reuses the first one's cached prefix and gives the
    greedy output it gives with the radix cache off, chunked prefill included; the idle invariant holds and the
    server info reports the pool."""
    from radixgen.runtime.engine import Engine

    gen = torch.Generator().manual_seed(7)
    shared = torch.randint(3, 49152, (40,), generator=gen).tolist()
    second = shared + torch.randint(3, 49152, (9,), generator=gen).tolist()
    params = {"max_new_tokens": 8, "temperature": 0.0, "ignore_eos": True}
    outs = {}
    for cache in (True, False):
        with Engine(model=str(tiny_model_dir("llama-hd64")), dtype="float32", kv_cache_dtype=kv,
                    max_total_tokens=2048, chunked_prefill_size=16, disable_radix_cache=not cache) as eng:
            eng.generate(input_ids=[shared + [5]], sampling_params=params)
            out = eng.generate(input_ids=[second], sampling_params=params)[0]
            info = eng.get_server_info()
            assert info["invariant_ok"]
            assert info["kv_cache"]["kv_cache_dtype"] == kv and info["max_total_num_tokens"] == 2048
            assert info["kv_cache"]["capacity_tokens"] == 2048
            outs[cache] = out
    assert outs[True]["meta_info"]["cached_tokens"] >= 32 and outs[False]["meta_info"]["cached_tokens"] == 0
    assert outs[True]["output_ids"] == outs[False]["output_ids"]
