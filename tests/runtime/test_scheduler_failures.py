"""One request never takes the scheduler down: a failure injected into one request's processing, at each stage,
fails that request alone (an abort with a message and a status code), the others finish with the outputs they
have without it, and the KV invariant holds afterwards. Also: requests larger than the KV cache, duplicate ids,
and stop regexes matched in linear time."""

from __future__ import annotations

import time

import pytest
import torch

from radixgen.common.sampling_params import SamplingParams
from radixgen.runtime.config import RuntimeConfig
from radixgen.runtime.executor.model_runner import ModelRunner
from radixgen.runtime.scheduler import Scheduler
from radixgen.runtime.scheduler import sampling as sampling_mod
from radixgen.runtime.scheduler.process import _make_grammar_backend
from radixgen.runtime.scheduler.request import FinishReason, GenerateRequest, ReqOutput
from radixgen.runtime.special_tokens import eos_token_ids


def make_scheduler(model_dir, tokenizer, grammar: bool = False, **kw) -> Scheduler:
    kw.setdefault("max_total_tokens", 2048)
    kw.setdefault("max_running_requests", 8)
    cfg = RuntimeConfig(model=str(model_dir), dtype="float32", **kw)
    runner = ModelRunner(cfg)
    stop_ids = eos_token_ids(runner.model_config.eos_token_ids, tokenizer)
    backend = _make_grammar_backend(cfg, tokenizer, runner.vocab_size, stop_ids) if grammar else None
    return Scheduler(cfg, runner, tokenizer, backend)


def run(sched: Scheduler, reqs: list[GenerateRequest], deadline_s: float = 120.0) -> dict[str, dict]:
    """Submit all, step until idle; per rid: the output ids and every finish reason received (exactly one).
    Bounded by time, not steps: while a grammar compiles in its thread, steps run nothing (and take no time)."""
    for r in reqs:
        sched.handle_message(r)
    out: dict[str, dict] = {}
    deadline = time.monotonic() + deadline_s
    while time.monotonic() < deadline:
        ran = sched.step()
        for msg in sched.outbox:
            if isinstance(msg, ReqOutput):
                o = out.setdefault(msg.rid, {"ids": [], "finishes": []})
                o["ids"] += msg.new_ids
                if msg.finish_reason is not None:
                    o["finishes"].append(msg.finish_reason)
        sched.outbox.clear()
        if not ran and sched.is_idle():
            break
        if not ran:
            time.sleep(0.002)
    assert sched.is_idle(), "the scheduler did not finish its work"
    assert sched.invariant_holds(), sched.server_info()
    for rid, o in out.items():
        assert len(o["finishes"]) == 1, (rid, o["finishes"])
        o["finish"] = o["finishes"][0]
    return out


def greedy(n: int = 10, **kw) -> SamplingParams:
    return SamplingParams(max_new_tokens=n, temperature=0.0, ignore_eos=True, **kw)


def others() -> list[GenerateRequest]:
    """Requests that must be undisturbed: one sharing the bad one's prefix, one not, one chunked-long."""
    head = list(range(500, 540))
    return [GenerateRequest("ok-shared", head + [7, 8, 9], greedy(12)),
            GenerateRequest("ok-plain", list(range(900, 930)), greedy(9)),
            GenerateRequest("ok-long", list(range(1200, 1300)), greedy(6))]


BAD_IDS = list(range(500, 540)) + [11, 12]


@pytest.fixture(scope="module")
def reference(model_dir, tokenizer):
    res = run(make_scheduler(model_dir, tokenizer), others())
    return {rid: o["ids"] for rid, o in res.items()}


def only_for_bad(real, pick_req):
    """Wrap a real component's method so that it raises for the request named "bad" only."""
    def wrapper(*args, **kwargs):
        if any(getattr(r, "rid", None) == "bad" for r in pick_req(*args, **kwargs)):
            raise RuntimeError("injected failure")
        return real(*args, **kwargs)
    return wrapper


def inject(stage: str, sched: Scheduler, monkeypatch) -> SamplingParams:
    """Make `stage` fail for the request "bad"; returns the bad request's sampling params."""
    kv, out = sched.kv, sched.output
    if stage == "admission":
        monkeypatch.setattr(kv, "admit", only_for_bad(kv.admit, lambda req: [req]))
    elif stage == "taking-in":  # the stop-regex setup of the bad request (the only one with a stop regex)
        def fail_regex(*a, **k):
            raise RuntimeError("injected failure")
        monkeypatch.setattr("radixgen.runtime.scheduler.intake.RegexStop", fail_regex)
        return greedy(8, stop_regex="zzzz")
    elif stage == "grammar-accept":
        real_new = sched.grammar.new_matcher

        def fail_accept(self, tok):
            raise RuntimeError("injected failure")

        def new_matcher(state):  # the bad request is the only constrained one: its matcher class fails
            m = real_new(state)
            monkeypatch.setattr(type(m), "accept_token", fail_accept)
            return m
        monkeypatch.setattr(sched.grammar, "new_matcher", new_matcher)
        return greedy(8, regex="[a-z]{5,40}")
    elif stage == "grammar-mask":  # the batched mask fill raises while the bad request is in the batch
        monkeypatch.setattr(sched.grammar, "mask_fn", only_for_bad(sched.grammar.mask_fn, lambda reqs: reqs))
        return greedy(8, regex="[a-z]{5,40}")
    elif stage == "sampling":  # SamplingBatch.build raises whenever the bad request's params are in it
        real = sampling_mod.SamplingBatch.build

        def build(params, *rest):
            if any(p.seed == 4242 for p in params):
                raise RuntimeError("injected failure")
            return real(params, *rest)
        monkeypatch.setattr(sampling_mod.SamplingBatch, "build", staticmethod(build))
        return greedy(8, seed=4242)
    elif stage == "stop-check":
        monkeypatch.setattr(out, "check_stop_strings", only_for_bad(out.check_stop_strings, lambda req: [req]))
        return greedy(8, stop=["never-there"])
    elif stage == "emission":
        real_of = out.output_of
        monkeypatch.setattr(out, "output_of", only_for_bad(real_of, lambda req: [req]))
    return greedy(8)


STAGES = ["admission", "taking-in", "grammar-accept", "grammar-mask", "sampling", "stop-check", "emission"]


@pytest.mark.parametrize("stage", STAGES)
def test_a_failure_in_one_request_fails_it_alone(model_dir, tokenizer, reference, stage, monkeypatch):
    sched = make_scheduler(model_dir, tokenizer, grammar=stage.startswith("grammar"), chunked_prefill_size=32)
    bad_params = inject(stage, sched, monkeypatch)
    reqs = others()
    reqs.insert(1, GenerateRequest("bad", BAD_IDS, bad_params))
    res = run(sched, reqs)
    bad = res["bad"]["finish"]
    assert bad.kind == "abort" and bad.status_code == 500, bad
    assert "injected failure" in bad.message and "RuntimeError" in bad.message
    assert {rid: o["ids"] for rid, o in res.items() if rid != "bad"} == reference
    assert all(o["finish"].kind == "length" for rid, o in res.items() if rid != "bad")
    assert sched.stats["failed_requests"] == 1
    # the scheduler goes on serving, and the bad request's id is free again
    monkeypatch.undo()
    again = run(sched, [GenerateRequest("bad", BAD_IDS, greedy(3))])["bad"]
    assert again["finish"] == FinishReason.length_limit(3)


def test_a_failed_forward_fails_its_batch_and_frees_its_kv(model_dir, tokenizer, reference, monkeypatch):
    sched = make_scheduler(model_dir, tokenizer)
    real = sched.runner.forward
    calls = {"n": 0}

    def forward(fi):
        calls["n"] += 1
        if calls["n"] == 3:  # a decode step of the first batch's requests
            raise RuntimeError("injected forward failure")
        return real(fi)
    monkeypatch.setattr(sched.runner, "forward", forward)
    first = run(sched, [GenerateRequest("a", list(range(100, 140)), greedy(10)),
                        GenerateRequest("b", list(range(200, 230)), greedy(10))])
    for o in first.values():
        assert o["finish"].kind == "abort" and o["finish"].status_code == 500
        assert "injected forward failure" in o["finish"].message
    # the scheduler keeps serving: later requests give the same outputs as in a fresh scheduler
    res = run(sched, others())
    assert {rid: o["ids"] for rid, o in res.items()} == reference


def test_request_larger_than_the_kv_cache_is_refused_up_front(model_dir, tokenizer):
    sched = make_scheduler(model_dir, tokenizer, max_total_tokens=300)
    res = run(sched, [GenerateRequest("big", list(range(100, 350)), greedy(100)),
                      GenerateRequest("fits", list(range(100, 150)), greedy(20))])
    big = res["big"]["finish"]
    assert big.kind == "abort" and big.status_code == 400
    assert "250 tokens" in big.message and "100" in big.message and "300" in big.message
    assert res["big"]["ids"] == []
    assert res["fits"]["finish"] == FinishReason.length_limit(20)


def test_finishing_always_reports(model_dir, tokenizer):
    """`finish` is the one way a request ends, and it sends the record: a request finished from the decode
    path (here: directly, as schedule_decode does when the cache cannot hold it) is never lost."""
    sched = make_scheduler(model_dir, tokenizer)
    sched.handle_message(GenerateRequest("r", list(range(100, 120)), greedy(50)))
    for _ in range(4):
        sched.step()
    sched.outbox.clear()
    (req,) = sched.running
    sched.finish(req, FinishReason.abort("the KV cache is too small for this request", 400))
    (msg,) = sched.outbox
    assert msg.rid == "r" and msg.finish_reason.status_code == 400
    assert sched.is_idle() and sched.invariant_holds()


def test_duplicate_rid_is_refused_without_touching_the_original(model_dir, tokenizer):
    sched = make_scheduler(model_dir, tokenizer)
    sched.handle_message(GenerateRequest("x", list(range(100, 130)), greedy(12)))
    sched.step()
    sched.handle_message(GenerateRequest("x", list(range(300, 310)), greedy(3)))
    dup = [m for m in sched.outbox if isinstance(m, ReqOutput) and m.duplicate]
    assert len(dup) == 1 and dup[0].finish_reason.status_code == 400
    assert "already in use" in dup[0].finish_reason.message
    early = [i for m in sched.outbox if isinstance(m, ReqOutput) and not m.duplicate for i in m.new_ids]
    sched.outbox.clear()
    res = run(sched, [])
    assert res["x"]["finish"] == FinishReason.length_limit(12) and len(early + res["x"]["ids"]) == 12


def test_stop_regex_with_catastrophic_backtracking(model_dir, tokenizer):
    """`(a+)+b` against a long run of 'a's: Python's re would take exponential time per check; the automaton
    is linear. The run of a's is forced by a regex constraint; another request runs beside it."""
    sched = make_scheduler(model_dir, tokenizer, grammar=True)
    p = SamplingParams(max_new_tokens=400, temperature=0.0, regex="a{120}", stop_regex=["zq", "(a+)+b"])
    stops = SamplingParams(max_new_tokens=400, temperature=0.0, regex="a{30}b{3}c", stop_regex="(a+)+b")
    res = run(sched, [GenerateRequest("as", list(range(100, 120)), p),
                      GenerateRequest("other", list(range(700, 730)), greedy(40)),
                      GenerateRequest("ab", list(range(100, 120)), stops)])
    assert tokenizer.decode(res["as"]["ids"], skip_special_tokens=True) == "a" * 120
    finish = res["as"]["finish"]  # the grammar ended it (its end token), not the regex
    assert finish.kind == "stop" and not isinstance(finish.matched, str)
    assert res["other"]["finish"] == FinishReason.length_limit(40)
    assert res["ab"]["finish"] == FinishReason.stop("a" * 30 + "b")
    assert tokenizer.decode(res["ab"]["ids"]).startswith("a" * 30 + "b")


def test_unsupported_stop_regex_is_a_400(model_dir, tokenizer):
    with pytest.raises(ValueError, match=r"stop_regex.*'\^ab'.*anchors"):
        greedy(5, stop_regex="^ab")  # refused when the request is built ...
    anchored = greedy(5)
    anchored.stop_regex = "^ab"  # ... and by the scheduler, should one get past that
    sched = make_scheduler(model_dir, tokenizer)
    res = run(sched, [GenerateRequest("anchored", list(range(100, 110)), anchored),
                      GenerateRequest("fine", list(range(100, 110)), greedy(5))])
    reason = res["anchored"]["finish"]
    assert reason.kind == "abort" and reason.status_code == 400 and "'^ab'" in reason.message
    assert res["fine"]["finish"] == FinishReason.length_limit(5)


def test_stop_regex_matches_across_tokens(model_dir, tokenizer):
    sched = make_scheduler(model_dir, tokenizer)
    ids = list(range(700, 720))
    toks = run(sched, [GenerateRequest("free", ids, greedy(24))])["free"]["ids"]
    text = tokenizer.decode(toks)
    # a literal pattern spanning the text of tokens 4..6
    start = len(tokenizer.decode(toks[:4]))
    piece = text[start:start + 6] if len(text) >= start + 6 else text[start:]
    pattern = "".join("\\" + c if not c.isalnum() else c for c in piece)
    res = run(sched, [GenerateRequest("re", ids, greedy(24, stop_regex=[pattern, "zzzz"]))])["re"]
    assert res["finish"].kind == "stop" and res["finish"].matched == piece
    assert res["ids"] == toks[:len(res["ids"])] and len(res["ids"]) <= 8
    assert torch.tensor(res["ids"]).numel() >= 1


def test_the_scheduler_stops_where_a_grammar_may_end(model_dir, tokenizer):
    """One derivation of the end ids: every id the grammar accepts as its end also stops the scheduler."""
    sched = make_scheduler(model_dir, tokenizer, grammar=True)
    grammar_ends = set(sched.grammar.stop_token_ids)
    assert grammar_ends and grammar_ends <= sched.sampling.eos_ids
    assert tokenizer.eos_token_id in sched.sampling.eos_ids
