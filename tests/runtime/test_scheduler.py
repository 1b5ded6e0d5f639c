"""The scheduler in-process on a tiny random model: the cache, chunking, retraction and page size must
never change greedy outputs; the KV invariant holds after every run."""

from __future__ import annotations

import time

import pytest
import torch

from radixgen.common.sampling_params import SamplingParams
from radixgen.runtime.config import RuntimeConfig
from radixgen.runtime.executor.model_runner import ModelRunner
from radixgen.runtime.scheduler import Scheduler
from radixgen.runtime.scheduler.request import AbortRequest, FinishReason, GenerateRequest, ReqOutput


def make_scheduler(model_dir, tokenizer, **kw) -> Scheduler:
    kw.setdefault("max_total_tokens", 4096)
    kw.setdefault("max_running_requests", 16)
    cfg = RuntimeConfig(model=str(model_dir), dtype="float32", **kw)
    return Scheduler(cfg, ModelRunner(cfg), tokenizer)


def run(sched: Scheduler, reqs: list[GenerateRequest], max_steps: int = 5000) -> dict[str, dict]:
    """Submit all, step until idle; return per rid the output ids, finish reason and cached tokens."""
    for r in reqs:
        sched.handle_message(r)
    out = {r.rid: {"ids": [], "finish": None, "cached": 0} for r in reqs}
    for _ in range(max_steps):
        ran = sched.step()
        for msg in sched.outbox:
            if isinstance(msg, ReqOutput):
                o = out.setdefault(msg.rid, {"ids": [], "finish": None, "cached": 0})
                o["ids"] += msg.new_ids
                o["finish"] = msg.finish_reason
                o["cached"] = msg.cached_tokens
                if msg.input_logprobs is not None:
                    o["input_logprobs"] = msg.input_logprobs
        sched.outbox.clear()
        if not ran and sched.is_idle():
            break
        if not ran:  # only waiting (an adapter read, a grammar compile: threads): give them the CPU
            time.sleep(0.002)
    assert sched.is_idle(), "the scheduler did not finish its work"
    assert sched.invariant_holds(), sched.server_info()
    return out


def workload(seed: int = 0, n: int = 12) -> list[GenerateRequest]:
    """Prompts sharing prefixes (a system-prompt-like head, and pairs of siblings), unequal lengths."""
    g = torch.Generator().manual_seed(seed)
    head = torch.randint(3, 49152, (40,), generator=g).tolist()
    reqs = []
    for i in range(n):
        mid = torch.randint(3, 49152, (5 + 7 * (i // 2),), generator=g).tolist()
        tail = torch.randint(3, 49152, (3 + i,), generator=g).tolist()
        ids = head + mid + tail if i % 3 else mid + tail
        params = SamplingParams(max_new_tokens=12 + 3 * (i % 4), temperature=0.0, ignore_eos=True)
        reqs.append(GenerateRequest(f"r{i}", ids, params))
    return reqs


def outputs(result: dict[str, dict]) -> dict[str, list[int]]:
    return {rid: o["ids"] for rid, o in result.items()}


CONFIGS = {
    "cache-off": dict(disable_radix_cache=True),
    "chunked": dict(chunked_prefill_size=8, max_prefill_tokens=24),
    "no-chunking": dict(chunked_prefill_size=0),
    "page-4": dict(page_size=4),
    "fcfs": dict(schedule_policy="fcfs"),
    "dfs-weight": dict(schedule_policy="dfs-weight"),
    "tiny-pool": dict(max_total_tokens=330),  # forces eviction and retraction
}


@pytest.fixture(scope="module")
def reference(model_dir, tokenizer):
    sched = make_scheduler(model_dir, tokenizer)
    res = run(sched, workload())
    assert sum(o["cached"] for o in res.values()) > 0, "the workload should hit the cache"
    return outputs(res)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_greedy_outputs_do_not_depend_on_cache_chunking_or_retraction(model_dir, tokenizer, reference, name):
    sched = make_scheduler(model_dir, tokenizer, **CONFIGS[name])
    res = run(sched, workload())
    assert outputs(res) == reference
    if name == "tiny-pool":
        assert sched.stats["retractions"] > 0
        assert sched.stats["evicted_tokens"] > 0
    if name == "cache-off":
        assert all(o["cached"] == 0 for o in res.values())
    if name == "chunked":
        assert sched.stats["extend_passes"] > 10


def test_repeated_prompt_and_second_chat_turn_hit_the_cache(model_dir, tokenizer):
    sched = make_scheduler(model_dir, tokenizer)
    ids = list(range(100, 160))
    p = SamplingParams(max_new_tokens=10, temperature=0.0, ignore_eos=True)
    first = run(sched, [GenerateRequest("a", ids, p)])["a"]
    again = run(sched, [GenerateRequest("b", ids, p)])["b"]
    assert again["cached"] >= len(ids) - 1
    assert again["ids"] == first["ids"]
    turn2 = ids + first["ids"] + list(range(300, 320))
    second = run(sched, [GenerateRequest("c", turn2, p)])["c"]
    assert second["cached"] >= len(ids) + len(first["ids"]) - 1


def test_siblings_queued_together_compute_their_shared_prefix_once(model_dir, tokenizer):
    sched = make_scheduler(model_dir, tokenizer)
    head = list(range(1000, 1200))
    p = SamplingParams(max_new_tokens=2, temperature=0.0, ignore_eos=True)
    reqs = [GenerateRequest(f"s{i}", head + [5000 + i, 6000 + i], p) for i in range(6)]
    res = run(sched, reqs)
    # one request computes the 200-token head; the five others find it in the tree
    assert sum(o["cached"] for o in res.values()) >= 5 * len(head)


def test_namespaces_never_share_kv(model_dir, tokenizer):
    sched = make_scheduler(model_dir, tokenizer)
    ids = list(range(200, 260))
    p = SamplingParams(max_new_tokens=3, temperature=0.0, ignore_eos=True)
    run(sched, [GenerateRequest("a", ids, p, cache_salt="alice")])
    other = run(sched, [GenerateRequest("b", ids, p, cache_salt="bob")])["b"]
    same = run(sched, [GenerateRequest("c", ids, p, cache_salt="alice")])["c"]
    assert other["cached"] == 0
    assert same["cached"] >= len(ids) - 1


def test_abort_frees_slots(model_dir, tokenizer):
    sched = make_scheduler(model_dir, tokenizer)
    p = SamplingParams(max_new_tokens=200, temperature=0.0, ignore_eos=True)
    sched.handle_message(GenerateRequest("long", list(range(10, 50)), p))
    for _ in range(5):
        sched.step()
    assert sched.running
    sched.handle_message(AbortRequest("long"))
    res = run(sched, [])
    assert res["long"]["finish"] == FinishReason.abort("aborted by the client")
    assert len(res["long"]["ids"]) < 200
    assert not sched.running and sched.invariant_holds()


def test_prefill_only_request_returns_prompt_logprobs(model_dir, tokenizer):
    import transformers as tf

    sched = make_scheduler(model_dir, tokenizer)
    ids = list(range(400, 430))
    warm = SamplingParams(max_new_tokens=0)
    run(sched, [GenerateRequest("warm", ids[:20], warm)])  # the first 20 tokens are now cached
    res = run(sched, [GenerateRequest("q", ids, warm, return_logprob=True, logprob_start_len=21)])["q"]
    assert res["ids"] == [] and res["finish"] == FinishReason.length_limit(0)
    assert res["cached"] == 20
    ref = tf.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    with torch.no_grad():
        lp = torch.log_softmax(ref(torch.tensor([ids])).logits[0].float(), -1)
    expected = [lp[p - 1, ids[p]].item() for p in range(21, len(ids))]
    assert res["input_logprobs"] == pytest.approx(expected, abs=1e-4)


def test_stop_conditions(model_dir, tokenizer):
    sched = make_scheduler(model_dir, tokenizer)
    ids = list(range(700, 720))
    free = run(sched, [GenerateRequest("f", ids, SamplingParams(max_new_tokens=24, temperature=0.0,
                                                                ignore_eos=True))])["f"]
    toks = free["ids"]
    # a stop string across the boundary of output tokens 5 and 6
    t5, t6 = tokenizer.decode(toks[5:6]), tokenizer.decode(toks[6:7])
    stop = t5[-2:] + t6[:2] if len(t5) >= 2 and len(t6) >= 2 else t5 + t6
    p = SamplingParams(max_new_tokens=24, temperature=0.0, ignore_eos=True, stop=[stop])
    res = run(sched, [GenerateRequest("s", ids, p)])["s"]
    assert res["finish"] == FinishReason.stop(stop)
    assert res["ids"] == toks[:len(res["ids"])] and len(res["ids"]) <= 7
    # a stop token id, and min_new_tokens holding it back
    p = SamplingParams(max_new_tokens=24, temperature=0.0, stop_token_ids=[toks[3]])
    res = run(sched, [GenerateRequest("t", ids, p)])["t"]
    assert res["finish"] == FinishReason.stop(toks[3]) and res["ids"] == toks[:4]
    p = SamplingParams(max_new_tokens=24, temperature=0.0, stop_token_ids=[toks[3]], min_new_tokens=6)
    res = run(sched, [GenerateRequest("m", ids, p)])["m"]
    assert len(res["ids"]) >= 6
    # max_new_tokens
    res = run(sched, [GenerateRequest("l", ids, SamplingParams(max_new_tokens=5, temperature=0.0,
                                                               ignore_eos=True))])["l"]
    assert res["finish"] == FinishReason.length_limit(5) and res["ids"] == toks[:5]


def test_ageing_bound_admits_an_unmatched_request(model_dir, tokenizer):
    """Under lpm a request with no cached prefix loses to every request with one; the ageing bound
    must still admit it within max_queue_wait_steps of arriving."""
    bound = 6
    sched = make_scheduler(model_dir, tokenizer, max_running_requests=1, max_queue_wait_steps=bound)
    head = list(range(900, 960))
    p = SamplingParams(max_new_tokens=1, temperature=0.0, ignore_eos=True)
    run(sched, [GenerateRequest("warm", head, p)])
    sched.handle_message(GenerateRequest("loner", list(range(3000, 3040)), p))
    arrival = sched.step_no
    admitted_at = None
    for i in range(60):
        sched.handle_message(GenerateRequest(f"hit{i}", head + [i + 5], p))
        sched.step()
        sched.outbox.clear()
        if admitted_at is None and all(r.rid != "loner" for r in sched.waiting):
            admitted_at = sched.step_no
    run(sched, [])
    assert admitted_at is not None and admitted_at - arrival <= bound + 2


def long_prompts(n: int, length: int, seed: int = 1) -> list[GenerateRequest]:
    g = torch.Generator().manual_seed(seed)
    return [GenerateRequest(f"long{i}", torch.randint(3, 49152, (length,), generator=g).tolist(),
                            SamplingParams(max_new_tokens=4, temperature=0.0, ignore_eos=True)) for i in range(n)]


def test_chunked_prompts_that_fit_alone_but_not_together_all_finish(model_dir, tokenizer):
    """Each 200-token prompt fits the 256-token pool, two do not: admitted together, their chunks would fill the
    pool with neither able to finish (the scheduler stalled for good). Admission counts the prompt tokens that
    admitted requests still owe, so the second waits; outputs equal those computed one at a time."""
    reqs = long_prompts(3, 200)
    alone = {}
    for r in reqs:
        alone.update(outputs(run(make_scheduler(model_dir, tokenizer, max_total_tokens=256), [r])))
    sched = make_scheduler(model_dir, tokenizer, max_total_tokens=256, chunked_prefill_size=32, max_running_requests=2)
    assert outputs(run(sched, long_prompts(3, 200), max_steps=600)) == alone


def test_stalled_prefills_are_unstalled_by_retracting_the_newest(model_dir, tokenizer, monkeypatch):
    """The safety net under that admission rule: prompts admitted together anyway (the rule bypassed for the first
    step) stall; the newest is retracted, its computed KV kept in the tree, and every request still finishes."""
    sched = make_scheduler(model_dir, tokenizer, max_total_tokens=256, chunked_prefill_size=32, max_running_requests=2)
    real = sched.kv.can_allocate
    monkeypatch.setattr(sched.kv, "can_allocate", lambda n, running=False: True if sched.step_no <= 1 else
                        real(n, running))
    out = run(sched, long_prompts(2, 200), max_steps=600)
    assert sched.counters.retractions >= 1
    assert all(len(o["ids"]) == 4 for o in out.values()), out
