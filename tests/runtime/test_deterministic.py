"""The deterministic mode on tiny random bf16 models (Llama; Qwen2 with its qkv bias), in-process: each probe's
output ids and logprobs are the bits it gets alone, beside 1, 7 and 63 random other requests, with the radix cache
off, after cached prefixes of several lengths, under chunked prefill, n-gram and draft-model speculation,
retraction, and on the layer-by-layer path instead of the fused decode step; a seeded probe at temperature 1 too.
Without the mode some of these round apart (the contrast test). Plus the refusals: what the mode cannot keep is
an error at start naming the combination."""

from __future__ import annotations

import pytest
import torch
from determinism_helpers import mismatches, others, prefix_holders, probe_results, probes, run, scheduler
from tiny_models import perturbed_model_dir, tiny_model_dir

from radixgen.kernels import cpu
from radixgen.runtime import deterministic
from radixgen.runtime.config import RuntimeConfig
from radixgen.runtime.layers import ops as ops_mod
from radixgen.runtime.layers.quantization import QuantSpec
from radixgen.runtime.loader import load_tokenizer

KL = cpu.lib() if cpu.available() else None
pytestmark = pytest.mark.skipif(KL is None or not KL.has_decode_step,
                                reason="the deterministic mode needs the AVX512-BF16 build of the CPU kernels")
VOCAB = 1000  # token ids the probes use (the tiny models' vocabulary is the default model's)


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def model(request):
    d = tiny_model_dir(request.param)
    return d, load_tokenizer(d)


@pytest.fixture(scope="module")
def reference(model):
    """Each probe alone: no cache, no chunking, nothing else in its steps."""
    d, tok = model
    want = {}
    for p in probes(VOCAB):
        want.update(probe_results(run(scheduler(d, tok, disable_radix_cache=True, chunked_prefill_size=0), [p])))
    return want


SCENARIOS = {
    "batch-2": (dict(), 1),
    "batch-8": (dict(), 7),
    "batch-64": (dict(max_prefill_tokens=8192), 63),
    "cache-off": (dict(disable_radix_cache=True), 12),
    "chunked-8": (dict(chunked_prefill_size=8, max_prefill_tokens=24), 6),
    "chunked-100": (dict(chunked_prefill_size=100, max_prefill_tokens=130), 6),
    "ngram": (dict(speculative_algorithm="ngram"), 6),
    "layer-by-layer": (dict(layer_by_layer=True), 12),
    "retraction": (dict(max_total_tokens=700, max_running_requests=16), 12),
}


def scenario(model, name: str, *, deterministic: bool = True, seed: int = 0):
    d, tok = model
    kw, n_others = SCENARIOS[name]
    sched = scheduler(d, tok, deterministic=deterministic, **kw)
    ps = probes(VOCAB)
    run(sched, prefix_holders(ps, vocab=VOCAB))  # cached prefixes of 1..200 tokens of the probes, unless cache-off
    res = run(sched, others(n_others, VOCAB, seed, ps) + ps)
    return sched, res


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_probes_keep_their_bits(model, reference, name):
    sched, res = scenario(model, name)
    assert mismatches(probe_results(res), reference) == []
    if name == "retraction":
        assert sched.stats["retractions"] > 0
    if name == "ngram":
        assert sched.stats["spec_draft_tokens"] > 0
    if name != "cache-off":
        assert sum(o["cached"] for rid, o in res.items() if rid.startswith("probe")) > 0


def test_probes_keep_their_bits_under_a_draft_model(model, reference):
    d, tok = model
    draft = perturbed_model_dir("llama", 0.01) if d.name == "llama" else d
    sched = scheduler(d, tok, speculative_algorithm="draft", speculative_draft_model=str(draft))
    sched.spec.drafter.forward_cost = 0.0  # a draft as large as its target never pays: make it draft anyway
    res = run(sched, others(5, VOCAB, 3, probes(VOCAB)) + probes(VOCAB))
    assert sched.stats["spec_draft_tokens"] > 0
    assert mismatches(probe_results(res), reference) == []


def test_without_the_mode_some_probes_round_apart(model):
    """The harness can fail: the default kernels give some probe other bits in some of these scenarios (the
    decode split follows the batch; prefill rows run another kernel than decode rows)."""
    d, tok = model
    want = {}
    for p in probes(VOCAB):
        sched = scheduler(d, tok, deterministic=False, disable_radix_cache=True, chunked_prefill_size=0)
        want.update(probe_results(run(sched, [p])))
    bad = [m for name in ("batch-64", "chunked-8", "layer-by-layer")
           for m in mismatches(probe_results(scenario(model, name, deterministic=False)[1]), want)]
    assert bad


@pytest.mark.parametrize(("kw", "named"), [
    (dict(device="cuda"), "device=cuda and CUDA graphs"),
    (dict(disable_cpu_kernels=True), "disable_cpu_kernels"),
    (dict(tp_size=4, ep_size=2), "ep_size=2"),
])
def test_what_the_mode_cannot_keep_is_refused_by_name(kw, named):
    with pytest.raises(ValueError, match=f"deterministic mode does not run with {named}"):
        RuntimeConfig(deterministic=True, **kw)


def test_the_runner_refuses_missing_kernels_or_another_dtype():
    ops = ops_mod.CpuOps(KL, deterministic=True)
    deterministic.check_deterministic(QuantSpec(), torch.bfloat16, ops, 64)  # what the tests above run
    deterministic.check_deterministic(QuantSpec(method="awq", group_size=128), torch.bfloat16, ops, 64)
    deterministic.check_deterministic(QuantSpec(method="fp8"), torch.bfloat16, ops, 64)  # as bf16 K pairs
    deterministic.check_deterministic(QuantSpec(), torch.float32, ops, 64)  # the fixed float32 chains
    with pytest.raises(ValueError, match="C kernels"):
        deterministic.check_deterministic(QuantSpec(), torch.bfloat16, ops_mod.CpuOps(None, deterministic=True), 64)
    with pytest.raises(ValueError, match="bfloat16 or float32 activations"):
        deterministic.check_deterministic(QuantSpec(), torch.float16, ops, 64)
    with pytest.raises(ValueError, match=f"head_dim={KL.d_max + 8}"):
        deterministic.check_deterministic(QuantSpec(), torch.bfloat16, ops, KL.d_max + 8)
    with pytest.raises(ValueError, match="must be a bool"):
        RuntimeConfig(deterministic="yes")


def test_the_runner_refuses_a_layer_off_the_c_matmuls():
    """An odd input size (129 MLP columns) keeps down_proj off the bf16 K-pair matmuls, whose blocking alone the
    mode holds to the row count: refused by the layer's name."""
    from radixgen.runtime.executor.model_runner import ModelRunner

    with pytest.raises(ValueError, match="every linear layer on radixgen's C matmuls .*down_proj runs onednn"):
        ModelRunner(RuntimeConfig(model=str(tiny_model_dir("llama-odd")), dtype="bfloat16", deterministic=True,
                                  max_total_tokens=256, max_running_requests=2))


def test_the_runner_refuses_an_mlp_part_it_does_not_cover(monkeypatch):
    """A layer whose MLP part is not the dense gated MLP (an expert block says so of itself) is refused by kind."""
    from radixgen.runtime.executor.model_runner import ModelRunner
    from radixgen.runtime.models import parts

    dense = parts.GatedMLP.structure
    monkeypatch.setattr(parts.GatedMLP, "structure", lambda self: dense(self)._replace(kind="experts"))
    with pytest.raises(ValueError, match="deterministic mode does not run layer 0's MLP part 'experts'"):
        ModelRunner(RuntimeConfig(model=str(tiny_model_dir("llama")), dtype="bfloat16", deterministic=True,
                                  max_total_tokens=256, max_running_requests=2))
