"""The deterministic mode on the bundled default model in bf16 (30 layers, head size 64: the bf16 dot products
of the attention kernel), in-process: each probe's output ids and logprobs are the bits it gets alone, beside 7
and 63 random other requests (some sharing its prefix), after cached prefixes, under chunked prefill, n-gram and
draft-model speculation, after retractions and on the layer-by-layer path; the offline API takes the mode too."""

from __future__ import annotations

import pytest
from determinism_helpers import mismatches, others, prefix_holders, probe_results, probes, run, scheduler

from radixgen.kernels import cpu
from radixgen.runtime.loader import load_tokenizer, resolve_model_path

KL = cpu.lib() if cpu.available() else None
pytestmark = [pytest.mark.slow, pytest.mark.skipif(KL is None or not KL.has_decode_step,
                                                   reason="the deterministic mode needs the AVX512-BF16 kernels")]
VOCAB = 49152
LENGTHS = (150, 300)  # probe prompts crossing the attention pieces' bounds
NEW = 8


@pytest.fixture(scope="module")
def model():
    return resolve_model_path(None), load_tokenizer(None)


def _probes():
    return probes(VOCAB, LENGTHS, NEW)


@pytest.fixture(scope="module")
def reference(model):
    d, tok = model
    sched = scheduler(d, tok, disable_radix_cache=True, chunked_prefill_size=0)
    want = {}
    for p in _probes():
        want.update(probe_results(run(sched, [p])))
    return want


@pytest.mark.parametrize(("name", "kw", "n_others"), [
    ("batch-8", dict(), 7),
    ("batch-64", dict(max_prefill_tokens=4096), 63),
    ("chunked-64", dict(chunked_prefill_size=64, max_prefill_tokens=96), 4),
    ("ngram", dict(speculative_algorithm="ngram"), 4),
    ("layer-by-layer", dict(layer_by_layer=True), 7),
])
def test_probes_keep_their_bits(model, reference, name, kw, n_others):
    d, tok = model
    sched = scheduler(d, tok, **kw)
    ps = _probes()
    run(sched, prefix_holders(ps, (17, 128, 129, 200), VOCAB))
    res = run(sched, others(n_others, VOCAB, 5, ps) + ps)
    assert mismatches(probe_results(res), reference) == []
    assert sum(o["cached"] for rid, o in res.items() if rid.startswith("probe")) > 0


def test_probes_keep_their_bits_under_draft_speculation(model, reference):
    """A draft model: the default model drafting for itself (forced to draft)."""
    d, tok = model
    sched = scheduler(d, tok, speculative_algorithm="draft", speculative_draft_model=str(d))
    sched.spec.drafter.forward_cost = 0.0  # a draft as large as its target never pays: make it draft anyway
    ps = _probes()
    res = run(sched, others(3, VOCAB, 6, ps) + ps)
    assert sched.stats["spec_draft_tokens"] > 0
    assert mismatches(probe_results(res), reference) == []


def test_probes_keep_their_bits_after_retraction(model, reference):
    """A pool small enough that decode retracts requests, which come back and recompute or reuse their KV."""
    d, tok = model
    sched = scheduler(d, tok, max_total_tokens=400, max_running_requests=16)
    ps = _probes()
    res = run(sched, others(4, VOCAB, 6, ps) + ps)
    assert sched.stats["retractions"] > 0
    assert mismatches(probe_results(res), reference) == []


def test_offline_llm_takes_the_mode():
    from radixgen.offline import LLM, SamplingParams

    llm = LLM(deterministic=True, max_total_tokens=4096)
    try:
        assert llm.engine.get_server_info()["deterministic"] is True
        outs = llm.generate(["The capital of France is"], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
        assert outs[0].outputs[0].token_ids
    finally:
        llm.engine.shutdown()


def test_tp2_keeps_the_bits_of_one_process(model):
    """tp 2 (two spawned ranks over gloo, one thread each) against one process at one thread: the probes after
    cached prefixes, beside random other requests, give the same ids and logprobs (determinism_helpers.group_workload;
    the tiny-model counterpart is tests/runtime/test_deterministic_parallel.py)."""
    import torch
    from determinism_helpers import group_workload
    from parallel_helpers import run_group

    from radixgen.runtime.config import RuntimeConfig
    from radixgen.runtime.executor.model_runner import ModelRunner

    d, _ = model
    config = dict(dtype="bfloat16", deterministic=True)
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        runner = ModelRunner(RuntimeConfig(model=str(d), max_total_tokens=2048, max_running_requests=8, **config))
        want = group_workload(runner)
        del runner
    finally:
        torch.set_num_threads(old)
    got = run_group(str(d), workload="determinism", tp_size=2, **config)
    assert got["fused"]
    assert mismatches(got["logits"], want) == []
