"""The deterministic mode on the builds of other CPUs (RADIXGEN_CPU_ISA's emulation: x86-64-v3 is an AVX2 CPU,
skylake-avx512 one with AVX-512 but no BF16), on quantized weights (a GGUF file from its own blocks: a Q4_K_M-like
layer of Q4_K and Q6_K, a Q4_0 layer, a Q8_0 embedding and LM head; int8), a mixture of experts (Qwen3-MoE, bf16
experts), LoRA adapters (two, and the base model, in one batch) and over 8-bit KV pools. Each probe's
output ids and logprobs are the bits it gets alone, beside other requests, from the radix cache (prefixes of 1..200
tokens cached first; through the host and disk tiers too), under chunked prefill and after a retraction. The full
set of scenarios runs on the cheapest case (AVX2, bf16), one batch scenario on the others. Plus what stays
refused, by name."""

from __future__ import annotations

import os

import pytest
import torch
from determinism_helpers import mismatches, others, prefix_holders, probe_results, probes, run, scheduler
from tiny_models import tiny_model_dir

from radixgen.kernels import _cpu_build, cpu
from radixgen.runtime import config as config_mod
from radixgen.runtime.config import RuntimeConfig
from radixgen.runtime.layers.linear import LinearBase
from radixgen.runtime.layers.quantization.experts import GroupedLinear
from radixgen.runtime.loader import load_tokenizer

gguf = pytest.importorskip("gguf")
VOCAB = 1000
T = gguf.GGMLQuantizationType
GGUF_TYPES = {  # (q, k, v, output, gate, up, down) per layer
    "gguf": [(T.Q4_K, T.Q4_K, T.Q6_K, T.Q4_K, T.Q4_K, T.Q4_K, T.Q6_K), (T.Q4_0,) * 7],
}
WANT_EXPERTS = {  # the experts' methods per MoE case
    ("native", "moe"): {"bf16 K pairs (grouped, C)"},
    ("x86-64-v3", "moe2"): {"bf16 K pairs (grouped, C), per expert"},
    ("skylake-avx512", "moe-int8"): {"int8 (grouped, C), per expert, 16 rows a call"},
    ("x86-64-v3", "moe-float32"): {"float32 fixed chains (per expert, C)"},
}
SCENARIOS = {  # name: (options, other requests beside the probes, requests run before them to evict the prefixes)
    "batch-8": (dict(), 7, 0),
    "chunked-100": (dict(chunked_prefill_size=100, max_prefill_tokens=130), 6, 0),
    "retraction": (dict(max_total_tokens=700, max_running_requests=16), 12, 0),
    # a host tier of about 200 tokens over a disk tier: the cached prefixes come back from disk; prompts in chunks
    "host-disk": (dict(page_size=16, hicache_write_policy="write_through", hicache_size=0.00005,
                       chunked_prefill_size=100, max_prefill_tokens=130, max_total_tokens=800,
                       max_running_requests=16), 3, 16),
}
CASES = [  # (build, weights, KV pool, scenarios)
    ("x86-64-v3", "bf16", "auto", ("retraction", "host-disk")),
    ("skylake-avx512", "int8", "int8", ("batch-8",)),
    ("native", "lora", "fp8_e4m3", ("batch-8",)),  # the fused decode step: LoRA deltas, an 8-bit pool
    ("x86-64-v3", "lora", "auto", ("batch-8",)),  # LoRA deltas on the torch path
    ("native", "moe", "auto", ("batch-8",)),  # Qwen3-MoE's bf16 experts on the grouped C matmuls
    ("x86-64-v3", "moe2", "auto", ("chunked-100",)),  # Qwen2-MoE's bf16 experts one at a time on the AVX2 K pairs
    ("skylake-avx512", "moe-int8", "auto", ("batch-8",)),  # int8 experts in calls of at most 16 rows
    ("x86-64-v3", "moe-float32", "auto", ("batch-8",)),  # float32 experts on the fixed float32 chains
    ("x86-64-v3", "gguf", "auto", ("batch-8",)),
    ("x86-64-v3", "float32", "auto", ("batch-8",)),  # float32 weights on the fixed float32 chains
    ("skylake-avx512", "fp8", "auto", ("batch-8",)),  # fp8 weights as the bf16 weight their upcast multiplies by
    ("native", "int4", "auto", ("batch-8",)),  # int4 tiles: a lone row (batch 1) with the bits of any tile
]


@pytest.fixture
def build(request, monkeypatch):
    """The kernels of build `request.param` as the runtime's (`cpu.lib()`), and RADIXGEN_CPU_ISA naming it."""
    missing = _cpu_build.missing_flags(request.param)
    if missing:
        pytest.skip(f"this CPU lacks {missing} for the {request.param} build")
    if not cpu.available():
        pytest.skip("the CPU kernels do not build here")
    monkeypatch.setenv("RADIXGEN_CPU_ISA", request.param)
    monkeypatch.setattr(cpu, "_lib", cpu.load(request.param))
    return request.param


def _adapters(reqs, names):
    """reqs with their LoRA adapters: names[i % len(names)] for the i-th (None: the base model)."""
    for i, r in enumerate(reqs):
        r.lora_name = names[i % len(names)]
    return reqs


def _model(weights: str, tmp_path_factory, monkeypatch):
    """(model path, RuntimeConfig options) of the weights named."""
    if weights in GGUF_TYPES:
        from test_gguf_native import write_tiny_gguf

        folder = tmp_path_factory.getbasetemp() / "deterministic-gguf"
        folder.mkdir(exist_ok=True)
        monkeypatch.setenv("RADIXGEN_CACHE", str(folder / "cache"))
        path = folder / f"{weights}.gguf"
        if not path.exists():
            tmp = path.with_suffix(f".{os.getpid()}.tmp")
            write_tiny_gguf(tmp, layer_types=GGUF_TYPES[weights])
            tmp.replace(path)
        return path, dict(quantization="gguf")
    if weights.startswith("moe"):
        fmt = weights.partition("-")[2]  # moe2: Qwen2-MoE (a shared expert behind its gate), moe: Qwen3-MoE
        kw = dict(dtype="float32") if fmt == "float32" else dict(quantization=fmt) if fmt else {}
        return tiny_model_dir("qwen2_moe" if weights.startswith("moe2") else "qwen3_moe"), kw
    if weights == "lora":
        from lora_helpers import make_adapter

        folder = tmp_path_factory.getbasetemp() / "deterministic-lora"
        for name, seed in (("a", 0), ("b", 1)):
            if not (folder / name).exists():
                make_adapter("llama", folder / name, seed=seed)
        return tiny_model_dir("llama"), dict(lora_paths=(f"a={folder / 'a'}", f"b={folder / 'b'}"))
    if weights == "float32":
        return tiny_model_dir("llama"), dict(dtype="float32")
    return tiny_model_dir("llama"), ({} if weights == "bf16" else dict(quantization=weights))


@pytest.mark.parametrize(("build", "weights", "kv", "names"), CASES, indirect=["build"],
                         ids=[f"{b}-{w}-kv-{kv}" for b, w, kv, _ in CASES])
def test_probes_keep_their_bits(build, weights, kv, names, tmp_path_factory, monkeypatch):
    path, kw = _model(weights, tmp_path_factory, monkeypatch)
    kw["kv_cache_dtype"] = kv
    tok = load_tokenizer(tiny_model_dir("llama"))  # the GGUF's vocabulary too, read faster than from the file
    assert config_mod.resolve_dtype("auto", "cpu") == "bfloat16"  # what the mode runs with by default
    alone = scheduler(path, tok, disable_radix_cache=True, chunked_prefill_size=0, **kw)
    assert alone.runner.ops.kl.isa == build

    def lora(reqs, names):
        return _adapters(reqs, names) if weights == "lora" else reqs

    want = {}
    for p in lora(probes(VOCAB), ["a", "b", None]):  # each alone, one after the other
        want.update(probe_results(run(alone, [p])))
    for name in names:
        opts, n_others, n_evicting = SCENARIOS[name]
        if name == "host-disk":
            opts = dict(opts, kv_cache_dir=str(tmp_path_factory.mktemp("kv-pages")))
        sched = scheduler(path, tok, **kw, **opts)
        ps = lora(probes(VOCAB), ["a", "b", None])
        run(sched, prefix_holders(ps, vocab=VOCAB))
        if n_evicting:
            run(sched, others(n_evicting, VOCAB, 5))
        res = run(sched, lora(others(n_others, VOCAB, 0, ps), ["b", None, "a"]) + ps)
        assert mismatches(probe_results(res), want) == [], name
        assert sum(o["cached"] for rid, o in res.items() if rid.startswith("probe")) > 0, name
        if name == "retraction":
            assert sched.stats["retractions"] > 0
        if name == "host-disk":
            assert sched.server_info()["hicache"]["disk_hit_tokens"] > 0
        fused = build == "native" and weights in ("bf16", "moe", "lora", "int4")
        assert (sched.runner.fused_decode is not None) == fused
    methods = {type(m.method).__name__ for m in alone.runner.model.modules() if isinstance(m, LinearBase)}
    experts = {m.method.name for m in alone.runner.model.modules() if isinstance(m, GroupedLinear)}
    if weights.startswith("moe"):  # the experts' C methods (names: layers/fixed_experts.py), the routers on C too
        assert experts == WANT_EXPERTS[build, weights]
        assert all(m.fixed_matmul is not None for m in alone.runner.model.modules() if hasattr(m, "fixed_matmul"))
    if weights == "float32":  # every matmul on the fixed float32 chains (none on oneDNN)
        assert methods == {"FixedFloat32"}
    if weights == "fp8":  # the fp8 layers as bf16 K pairs, none left on the upcast path
        assert "FP8Linear" not in methods and "CpuPackedLinear" in methods


def test_the_emulated_cpus_answer_for_their_bf16(monkeypatch):
    """cpu_has_fast_bf16 (what dtype auto asks first) answers for the CPU the build is for, not this one."""
    for isa, fast in (("x86-64-v3", False), ("skylake-avx512", False), ("cooperlake", True)):
        monkeypatch.setenv("RADIXGEN_CPU_ISA", isa)
        assert config_mod.cpu_has_fast_bf16() is fast, isa


@pytest.mark.parametrize(("kw", "named"), [
    (dict(tp_size=2, ep_size=2), "ep_size=2"),
    (dict(enable_hierarchical_cache=True, hicache_kv_format="int8"), "hicache_kv_format=int8"),
])
def test_what_stays_refused_is_refused_by_name(kw, named):
    with pytest.raises(ValueError, match=f"deterministic mode does not run with {named}"):
        RuntimeConfig(deterministic=True, **kw)


def test_the_host_tier_keeps_the_pools_bits():
    """The host tier's auto format is int8 codes on the CPU (lossy), the pool's own format in the mode."""
    assert RuntimeConfig(enable_hierarchical_cache=True).hicache_code_dtype == torch.int8
    assert RuntimeConfig(enable_hierarchical_cache=True, deterministic=True).hicache_code_dtype is None


def test_the_runner_takes_bf16_and_float32_activations():
    from radixgen.runtime import deterministic
    from radixgen.runtime.layers import ops as ops_mod
    from radixgen.runtime.layers.quantization import QuantSpec

    ops = ops_mod.CpuOps(cpu.load("x86-64-v3") if not _cpu_build.missing_flags("x86-64-v3") else None, True)
    if ops.kl is None:
        pytest.skip("no AVX2 build here")
    deterministic.check_deterministic(QuantSpec(method="gguf"), torch.bfloat16, ops, 64)
    deterministic.check_deterministic(QuantSpec(), torch.float32, ops, 64)
    with pytest.raises(ValueError, match="bfloat16 or float32 activations"):
        deterministic.check_deterministic(QuantSpec(), torch.float16, ops, 64)
    with pytest.raises(ValueError, match="C kernels"):
        deterministic.check_deterministic(QuantSpec(), torch.bfloat16, ops_mod.CpuOps(None, True), 64)


def test_tp2_is_refused_on_a_build_without_the_fixed_tiles():
    """tp 2's fixed segments are AVX512-BF16 code: on the AVX2 build a row-parallel layer at tp 2 is refused by
    name and build; quantized weights at tp 2 on any build by their method."""
    from types import SimpleNamespace

    from radixgen.runtime.layers import fixed_order

    if _cpu_build.missing_flags("x86-64-v3") or not cpu.available():
        pytest.skip("no AVX2 build here")
    layer = SimpleNamespace(tp=SimpleNamespace(size=2), method=SimpleNamespace(name="int8 (C)"))
    with pytest.raises(ValueError, match="tp_size=2 on the x86-64-v3 build .* layers.0.o_proj"):
        fixed_order._fix("layers.0.o_proj", layer, cpu.load("x86-64-v3"), quantized=False)
    if not _cpu_build.missing_flags("cooperlake"):
        with pytest.raises(ValueError, match="layers.0.o_proj at tp_size=2: its int8 .C. weights"):
            fixed_order._fix("layers.0.o_proj", layer, cpu.load("cooperlake"), quantized=True)


def test_the_engine_on_an_avx2_cpu_with_the_default_dtype(monkeypatch):
    """The offline LLM (its Engine and scheduler process) with deterministic=True and dtype left to auto, on the
    AVX2 build: prompts alone and in one batch with others give the same ids and logprobs."""
    if _cpu_build.missing_flags("x86-64-v3") or not cpu.available():
        pytest.skip("no AVX2 build here")
    from radixgen.offline import LLM, SamplingParams

    monkeypatch.setenv("RADIXGEN_CPU_ISA", "x86-64-v3")  # read by the scheduler process
    llm = LLM(model=str(tiny_model_dir("llama")), deterministic=True, max_total_tokens=4096)
    try:
        sp = SamplingParams(temperature=0, max_tokens=6, logprobs=1)
        prompts = ["The capital of France is", "Once upon a time there was a dragon who " * 6, "1 2 3 4"]

        def bits(o):
            return o.token_ids, [[(t, lp.logprob) for t, lp in d.items()] for d in o.logprobs]

        alone = [bits(llm.generate([p], sp, use_tqdm=False)[0].outputs[0]) for p in prompts]
        batch = llm.generate(prompts + ["other " * 40, "x y z"], sp, use_tqdm=False)
        assert [bits(o.outputs[0]) for o in batch[:3]] == alone
    finally:
        llm.engine.shutdown()
