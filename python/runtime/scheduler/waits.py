"""What a request waits for before admission: one mechanism for every background job and resource.

A request may hold pending conditions (`req.waits`): future-like objects with `done()` / `result()` / `error()`,
polled without blocking. Today: its grammar compiling (`GrammarCompile`), its LoRA adapter's slot (`AdapterSlot`:
read from disk into a slot on the LoRA manager's thread, then held) and its cached prefix coming back from the
hierarchical cache's host and disk tiers (`KVLoadBack`). (Images need no condition: their encoder runs inside the
step that computes their rows, batched over the step's requests, executor/encoder_cache.py.) Each step
`WaitList.poll` looks at every waiting request once: one whose condition failed ends alone (that condition's message
and status code), one whose conditions are all done joins the admission queue, the others stay. A request that is
aborted while it waits ends at once; ending releases what its conditions hold (the scheduler's `finish` does, as for
any request), so nothing is leaked.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from typing import Protocol

from radixgen.runtime.messages import FinishReason
from radixgen.runtime.scheduler.request import Req


class Condition(Protocol):
    stage: str  # what the scheduler was doing for the request, in the message of an unexpected exception

    def done(self) -> bool:
        """Non-blocking: finished, with a result or an error."""

    def error(self) -> FinishReason | None:
        """Once done: why the request cannot run (it is ended with this), or None."""

    def result(self) -> object:
        """Once done without an error: the outcome (what `settle` puts on the request)."""

    def settle(self, req: Req) -> None:
        """Once done without an error: give the request what it waited for."""


class GrammarCompile:
    """The request's constraint compiling on the grammar backend's threads (shared between equal constraints)."""

    stage = "compiling the grammar of"

    def __init__(self, backend, constraint: tuple[str, str]) -> None:
        self.backend = backend
        self.handle = backend.submit(*constraint)
        self._state = None  # the backend's answer once polled: a compiled grammar or its ConstraintError

    def done(self) -> bool:
        if self._state is None:
            self._state = self.backend.poll(self.handle)
        return self._state is not None

    def error(self) -> FinishReason | None:
        return FinishReason.abort(str(self._state), 400) if isinstance(self._state, Exception) else None

    def result(self):
        return self._state

    def settle(self, req: Req) -> None:
        req.grammar = self.backend.new_matcher(self._state)


class AdapterSlot:
    """The request's LoRA adapter resident in a pool slot, held by the request (the manager's `acquire`: its read
    from disk is started when a slot can be had). Done once held; failed when the adapter's read fails while the
    request waits (a later request tries again)."""

    stage = "loading the LoRA adapter of"

    def __init__(self, lora, req: Req) -> None:
        self.lora, self.req = lora, req
        self.failures_seen = req.lora.read_failures

    def done(self) -> bool:
        return self.error() is not None or self.lora.acquire(self.req)

    def error(self) -> FinishReason | None:
        entry = self.req.lora
        if entry.read_failures == self.failures_seen:
            return None
        return FinishReason.abort(f"LoRA adapter {entry.name!r} could not be read: {entry.read_error}", 500)

    def result(self) -> int:
        return self.req.lora_slot

    def settle(self, req: Req) -> None:
        pass  # acquire has put the slot on the request


class KVLoadBack:
    """The request's cached prefix coming back from the hierarchical cache's lower tiers (scheduler/tiers/): planned
    at the first poll (the host tier's part needs no wait; the disk tier's pages are read on the store's threads
    while other requests step), copied into the pool and the tree once done and once the pool has room for it
    beside the loads of requests ahead (`may_load`), so admission matches the whole prefix.
    Never fails the request: a page that cannot be read is a miss, and the request computes it."""

    stage = "loading the cached KV of"

    def __init__(self, hicache, req: Req) -> None:
        self.hicache, self.req = hicache, req
        self.planned = False

    def done(self) -> bool:
        if not self.planned:
            self.planned = True
            self.req.kv_load = self.hicache.plan(self.req)
        load = self.req.kv_load
        return load is None or (load.ready() and self.hicache.may_load(load))

    def error(self) -> FinishReason | None:
        return None

    def result(self):
        return self.req.kv_load

    def settle(self, req: Req) -> None:
        load, req.kv_load = req.kv_load, None
        if load is not None:
            self.hicache.load_back(req, load)


class WaitList:
    """The requests with pending conditions, in arrival order; `poll` moves the ready ones to the queue."""

    def __init__(self, queue: deque[Req], finish: Callable[[Req, FinishReason], None],
                 fail: Callable[[Req, str, BaseException], None]) -> None:
        self.queue = queue  # the scheduler's waiting (admission) queue
        self.finish, self.fail = finish, fail
        self.reqs: list[Req] = []
        self._front: set[int] = set()  # id() of the requests that go to the queue's front (retracted ones)

    def add(self, req: Req, conditions: list[Condition], front: bool = False) -> None:
        """Queue `req` once `conditions` are done (at once when there are none); `front`: ahead of the queue."""
        req.waits = list(conditions)
        if not req.waits:
            self.queue.appendleft(req) if front else self.queue.append(req)
            return
        if front:
            self._front.add(id(req))
        self.reqs.append(req)

    def poll(self) -> None:
        for req in list(self.reqs):
            stage = "waiting for the resources of"
            try:
                if req.to_abort:
                    self.finish(req, FinishReason.abort(req.to_abort))
                    continue
                failed = None
                while req.waits:  # in order: a later condition may need an earlier one
                    cond = req.waits[0]
                    stage = cond.stage
                    if not cond.done():
                        break
                    failed = cond.error()
                    if failed is not None:
                        break
                    cond.settle(req)
                    req.waits.pop(0)
                if failed is not None:
                    self.finish(req, failed)
                elif not req.waits:
                    front = id(req) in self._front
                    self.remove(req)
                    self.queue.appendleft(req) if front else self.queue.append(req)
            except Exception as e:  # noqa: BLE001 - fails this request alone
                self.fail(req, stage, e)

    def remove(self, req: Req) -> None:
        """Take a request out (it ends, or it joins the queue); its conditions go with it."""
        if req in self.reqs:
            self.reqs.remove(req)
            self._front.discard(id(req))

    def __len__(self) -> int:
        return len(self.reqs)

    def __contains__(self, req: Req) -> bool:
        return req in self.reqs
