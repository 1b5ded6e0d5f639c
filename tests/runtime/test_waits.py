"""The scheduler's one waiting mechanism (scheduler/waits.py) on its own: a request joins the admission queue only
once all its conditions are done (in order, polled without blocking), a failed condition ends that request alone
with its message and status code, an abort while waiting ends it at once, an unexpected exception fails it naming
the condition's stage, and a retracted request goes back to the front of the queue."""

from __future__ import annotations

from collections import deque

from radixgen.common.sampling_params import SamplingParams
from radixgen.runtime.messages import FinishReason
from radixgen.runtime.scheduler.request import GenerateRequest, Req
from radixgen.runtime.scheduler.waits import WaitList


class Settable:
    """A condition the test finishes by hand."""

    stage = "doing X for"

    def __init__(self, name: str, log: list) -> None:
        self.name, self.log = name, log
        self.state = None  # None: running; "ok" or a FinishReason once done
        self.polls = 0

    def done(self) -> bool:
        self.polls += 1
        if self.state == "boom":
            raise RuntimeError("condition broke")
        return self.state is not None

    def error(self):
        return self.state if isinstance(self.state, FinishReason) else None

    def result(self):
        return self.name

    def settle(self, req: Req) -> None:
        self.log.append((req.rid, self.result()))


def make():
    queue: deque[Req] = deque()
    ended: list[tuple[str, FinishReason]] = []
    failed: list[tuple[str, str, str]] = []

    def finish(req, reason):
        ended.append((req.rid, reason))
        waits.remove(req)

    def fail(req, stage, exc):
        failed.append((req.rid, stage, str(exc)))
        waits.remove(req)

    waits = WaitList(queue, finish, fail)
    return waits, queue, ended, failed


def req(rid: str) -> Req:
    return Req(GenerateRequest(rid, [1, 2, 3], SamplingParams(max_new_tokens=4)), 0)


def test_a_request_is_queued_only_once_every_condition_is_done_in_order():
    waits, queue, ended, _ = make()
    log: list = []
    a, b = req("a"), req("b")
    first, second = Settable("grammar", log), Settable("adapter", log)
    waits.add(a, [first, second])
    waits.add(b, [])  # nothing to wait for: queued at once
    assert list(queue) == [b] and len(waits) == 1 and a in waits
    waits.poll()
    assert list(queue) == [b] and second.polls == 0  # the second is looked at once the first is done
    second.state = "ok"
    waits.poll()
    assert list(queue) == [b] and not log
    first.state = "ok"
    waits.poll()
    assert list(queue) == [b, a] and log == [("a", "grammar"), ("a", "adapter")] and not len(waits)
    assert not a.waits and not ended


def test_a_failed_condition_ends_its_request_alone_with_its_reason():
    waits, queue, ended, _ = make()
    bad, good = Settable("grammar", []), Settable("grammar", [])
    a, b = req("a"), req("b")
    waits.add(a, [bad])
    waits.add(b, [good])
    bad.state = FinishReason.abort("invalid regex: ...", 400)
    waits.poll()
    assert ended == [("a", FinishReason.abort("invalid regex: ...", 400))] and b in waits and a not in waits
    good.state = "ok"
    waits.poll()
    assert list(queue) == [b]


def test_an_abort_while_waiting_ends_the_request_and_nothing_is_polled():
    waits, queue, ended, _ = make()
    cond = Settable("adapter", [])
    a = req("a")
    waits.add(a, [cond])
    a.to_abort = "aborted by the client"
    waits.poll()
    assert ended == [("a", FinishReason.abort("aborted by the client"))] and cond.polls == 0
    assert not len(waits) and not queue


def test_an_exception_fails_the_request_naming_the_stage():
    waits, queue, _, failed = make()
    cond = Settable("x", [])
    a, b = req("a"), req("b")
    waits.add(a, [cond])
    waits.add(b, [])
    cond.state = "boom"
    waits.poll()
    assert failed == [("a", "doing X for", "condition broke")] and list(queue) == [b]


def test_a_retracted_request_goes_to_the_front():
    waits, queue, _, _ = make()
    a, b, c = req("a"), req("b"), req("c")
    waits.add(a, [])
    cond = Settable("adapter", [])
    waits.add(b, [cond], front=True)
    waits.add(c, [], front=True)
    assert list(queue) == [c, a]
    cond.state = "ok"
    waits.poll()
    assert list(queue) == [b, c, a]


def test_in_the_scheduler_an_abort_during_a_grammar_compile_leaks_nothing(model_dir, tokenizer):
    """A real scheduler: a request aborted while its (heavy) grammar compiles ends at once with the abort, the other
    request runs, and the scheduler goes idle with its invariant holding."""
    import json

    from test_scheduler import run
    from test_scheduler_failures import greedy, make_scheduler

    from radixgen.runtime.scheduler.request import AbortRequest

    heavy = json.dumps({"type": "object", "properties": {
        f"field_{i}": {"type": "string", "pattern": "[a-z]{2,30}@[a-z]{1,20}\\.(com|org)"} for i in range(40)}})
    sched = make_scheduler(model_dir, tokenizer, grammar=True)
    sched.handle_message(GenerateRequest("json", [5, 6, 7], SamplingParams(max_new_tokens=8, json_schema=heavy)))
    sched.handle_message(GenerateRequest("plain", [8, 9, 10], greedy(4)))
    sched.step()
    assert [r.rid for r in sched.waits.reqs] == ["json"]
    sched.handle_message(AbortRequest("json"))
    out = run(sched, [])
    assert out["json"]["finish"] == FinishReason.abort("aborted by the client") and out["json"]["ids"] == []
    assert out["plain"]["finish"] == FinishReason.length_limit(4)
    assert not len(sched.waits) and not sched.rids
