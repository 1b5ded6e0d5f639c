"""The bit-identity harness of the deterministic mode (tests/runtime/test_deterministic.py and the default model's
e2e test): a few probe requests, computed alone as the reference, then again beside random other requests under
each configuration; a probe's output ids and logprobs must come back as the same bits."""

from __future__ import annotations

import torch

from radixgen.common.sampling_params import SamplingParams
from radixgen.runtime.config import RuntimeConfig
from radixgen.runtime.executor.model_runner import ModelRunner
from radixgen.runtime.messages import GenerateRequest, ReqOutput
from radixgen.runtime.scheduler import Scheduler


def scheduler(model_dir, tokenizer, *, layer_by_layer: bool = False, **kw) -> Scheduler:
    kw.setdefault("max_total_tokens", 16384)
    kw.setdefault("max_running_requests", 64)
    kw.setdefault("deterministic", True)
    kw.setdefault("dtype", "bfloat16")
    cfg = RuntimeConfig(model=str(model_dir), **kw)
    runner = ModelRunner(cfg)
    if layer_by_layer:
        runner.fused_decode = None  # every decode step on the layer-by-layer path
    return Scheduler(cfg, runner, tokenizer)


def run(sched: Scheduler, reqs: list[GenerateRequest], max_steps: int = 20000) -> dict[str, dict]:
    """Submit all, step until idle -> per rid: ids, logprobs (output), cached (tokens)."""
    for r in reqs:
        sched.handle_message(r)
    out = {r.rid: {"ids": [], "logprobs": [], "cached": 0} for r in reqs}
    for _ in range(max_steps):
        ran = sched.step()
        for msg in sched.outbox:
            if isinstance(msg, ReqOutput):
                o = out[msg.rid]
                o["ids"] += msg.new_ids
                o["logprobs"] += msg.output_logprobs
                o["cached"] = msg.cached_tokens
        sched.outbox.clear()
        if not ran and sched.is_idle():
            break
    assert sched.is_idle(), "the scheduler did not finish its work"
    assert sched.invariant_holds(), sched.server_info()
    return out


def _ids(g: torch.Generator, n: int, vocab: int) -> list[int]:
    return torch.randint(3, vocab, (n,), generator=g).tolist()


def probes(vocab: int, lengths=(150, 40, 300), new_tokens: int = 16) -> list[GenerateRequest]:
    """Greedy probes whose contexts cross the fixed attention pieces' bounds, and one seeded probe at
    temperature 1."""
    g = torch.Generator().manual_seed(7)
    reqs = [GenerateRequest(f"probe{i}", _ids(g, n, vocab), SamplingParams(
        max_new_tokens=new_tokens, temperature=0.0, ignore_eos=True), return_logprob=True)
        for i, n in enumerate(lengths)]
    reqs.append(GenerateRequest("probe-seeded", _ids(g, 90, vocab), SamplingParams(
        max_new_tokens=new_tokens, temperature=1.0, seed=1234, ignore_eos=True), return_logprob=True))
    return reqs


def others(n: int, vocab: int, seed: int, share_with: list[GenerateRequest] = ()) -> list[GenerateRequest]:
    """n random requests: lengths 1..320, greedy or sampled, some sharing a prefix of a probe."""
    g = torch.Generator().manual_seed(seed)
    reqs = []
    for i in range(n):
        ids = _ids(g, int(torch.randint(1, 320, (1,), generator=g)), vocab)
        if share_with and i % 3 == 0:
            p = share_with[i % len(share_with)].input_ids
            ids = p[:int(torch.randint(1, len(p), (1,), generator=g))] + ids[:20]
        t = float(torch.rand((), generator=g)) if i % 2 else 0.0
        reqs.append(GenerateRequest(f"other{seed}-{i}", ids, SamplingParams(
            max_new_tokens=int(torch.randint(1, 24, (1,), generator=g)), temperature=t, ignore_eos=True),
            return_logprob=bool(i % 2)))
    return reqs


def prefix_holders(probe_reqs: list[GenerateRequest], lengths=(1, 17, 128, 129, 200), vocab: int = 1000):
    """Requests sharing the first k tokens of a probe (k in `lengths`, where the probe has them), then going
    elsewhere: run first, they leave a cached prefix of each length, computed in their own steps."""
    g = torch.Generator().manual_seed(99)
    reqs = []
    for p in probe_reqs:
        for k in lengths:
            if k < len(p.input_ids):
                reqs.append(GenerateRequest(f"holder-{p.rid}-{k}", p.input_ids[:k] + _ids(g, 5, vocab),
                                            SamplingParams(max_new_tokens=3, temperature=0.0, ignore_eos=True)))
    return reqs


def probe_results(result: dict[str, dict]) -> dict[str, tuple[list[int], list[float]]]:
    return {rid: (o["ids"], o["logprobs"]) for rid, o in result.items() if rid.startswith("probe")}


def mismatches(got: dict, want: dict) -> list[str]:
    """The probes whose ids or logprobs differ from the reference in any bit (logprobs as float32 bits)."""
    bad = []
    for rid, (ids, lps) in want.items():
        g_ids, g_lps = got[rid]
        if g_ids != ids or not torch.equal(torch.tensor(g_lps).view(torch.int32), torch.tensor(lps).view(torch.int32)):
            bad.append(rid)
    return bad


def group_workload(runner: ModelRunner, n_others: int = 7,
                   alone: bool = False) -> dict[str, tuple[list[int], list[float]]] | tuple[dict, dict]:
    """The probes' results on `runner` (rank 0 of a parallel group, parallel_helpers.run_group(workload=
    "determinism"), or one process): cached prefixes of several lengths first, then the probes beside random other
    requests (some sharing their prefixes), under the runner's config. alone: each probe run alone first, on the
    same runner, before anything is cached: (batched results, alone results)."""
    from radixgen.runtime.loader import load_tokenizer
    from radixgen.runtime.scheduler.pipeline import PipelineScheduler

    cfg = runner.runtime_config
    sched = (PipelineScheduler if cfg.pp_size > 1 else Scheduler)(cfg, runner, load_tokenizer(runner.model_path))
    vocab = 49152  # prompts reading both halves of a vocabulary-parallel embedding
    want = {}
    if alone:
        for p in probes(vocab):
            want.update(probe_results(run(sched, [p])))
    ps = probes(vocab)
    run(sched, prefix_holders(ps, vocab=vocab))
    res = run(sched, others(n_others, vocab, 11, ps) + ps)
    assert sum(o["cached"] for rid, o in res.items() if rid.startswith("probe")) > 0, "no probe hit the cache"
    return (probe_results(res), want) if alone else probe_results(res)
