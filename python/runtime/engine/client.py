"""The Engine's link to the scheduler process: start it, send it messages over zmq, and receive its outputs on a
background thread, which updates the `RequestState` of each request in flight and wakes its waiter.

One request's trouble stays that request's: a failure while taking in its output (a tokenizer that raises on
its ids) ends that request alone with an error, and the thread goes on serving the others.
"""

from __future__ import annotations

import asyncio
import atexit
import itertools
import logging
import pickle
import tempfile
import threading
import time
import weakref
from pathlib import Path

import zmq

from radixgen.runtime.config import RuntimeConfig
from radixgen.runtime.engine.ranks import GroupHost, RankProcess, first_dead
from radixgen.runtime.engine.request_state import RequestError, RequestState
from radixgen.runtime.messages import (
    AbortRequest,
    ControlReply,
    ControlRequest,
    FatalError,
    GenerateRequest,
    ReadySignal,
    ReqOutput,
)
from radixgen.runtime.rank_args import RankArgs, node_ranks

logger = logging.getLogger(__name__)

START_TIMEOUT_S = 600.0


class SchedulerClient:
    """Owns the scheduler process (and, with tensor / pipeline parallelism, the other ranks of node 0 and the
    group's meeting point: ranks.py), the two zmq sockets and the receiver thread. `ready` is the scheduler's
    ready signal (sizes of the model and the KV pool). A rank that dies makes the client fatal, as the
    scheduler's own death does; the other ranks are then stopped."""

    def __init__(self, config: RuntimeConfig, model_path: str) -> None:
        self._states: dict[str, RequestState] = {}  # in flight, by the scheduler's rid
        self._groups: dict[str, list[str]] = {}  # a caller's rid -> the rids made from it (batches, n > 1)
        self._lock = threading.Lock()  # a rid is checked and registered in one step
        self._replies: dict[int, tuple[threading.Event, list]] = {}
        self._reply_ids = itertools.count(1)
        self._send_lock = threading.Lock()
        self.closed = False
        self._stopping = False
        self.fatal: str | None = None

        self._zmq = zmq.Context()
        ipc = tempfile.mkdtemp(prefix="radixgen-")
        to_sched, from_sched = f"ipc://{ipc}/in", f"ipc://{ipc}/out"
        self._out = self._zmq.socket(zmq.PUSH)
        self._out.bind(to_sched)
        self._in = self._zmq.socket(zmq.PULL)
        self._in.bind(from_sched)
        self._group: GroupHost | None = None
        store_addr = None
        if config.world_size > 1:  # may raise (a taken port): nothing is started yet
            from radixgen.runtime.config import ModelConfig
            from radixgen.runtime.loader import read_hf_config

            self._group = GroupHost(config, ModelConfig.from_hf(read_hf_config(Path(model_path))))
            store_addr = self._group.addr
        self._procs = [RankProcess(RankArgs(config, model_path, r, store_addr,
                                            (to_sched, from_sched) if r == 0 else None), ipc)
                       for r in node_ranks(config)]
        self._proc = self._procs[0]  # rank 0: the scheduler
        self._finalizer = weakref.finalize(self, _stop_all, self._procs)
        atexit.register(self._finalizer)
        self.ready = self._wait_ready()
        self._receiver = threading.Thread(target=self._receive_loop, name="radixgen-receiver", daemon=True)
        self._receiver.start()

    # ------------------------------------------------------------------ lifecycle

    def _wait_ready(self) -> ReadySignal:
        poller = zmq.Poller()
        poller.register(self._in, zmq.POLLIN)
        waited = 0.0
        while waited < START_TIMEOUT_S:
            if poller.poll(200):
                msg = pickle.loads(self._in.recv())
                if isinstance(msg, FatalError):
                    self._shutdown_process()
                    raise RuntimeError(f"the scheduler process failed to start:\n{msg.message}")
                if isinstance(msg, ReadySignal):
                    return msg
            elif first_dead(self._procs) is not None:
                dead = first_dead(self._procs)
                self._shutdown_process()
                raise RuntimeError(f"{_name(dead)} exited during start (code {dead.exitcode})")
            if self._group is not None:
                try:
                    self._group.check()
                except RuntimeError:
                    self._shutdown_process()
                    raise
            waited += 0.2
        self._shutdown_process()
        raise RuntimeError("the scheduler process did not start in time")

    def shutdown(self) -> None:
        if self.closed:
            return
        self._stopping = True
        try:
            if self._proc.is_alive() and self.fatal is None:
                self.control("shutdown", timeout=10.0)
        except Exception:  # noqa: BLE001 - shutting down anyway
            pass
        self.closed = True
        self._receiver.join(timeout=2.0)
        self._shutdown_process()
        self._fail_all("the engine was shut down")

    def _shutdown_process(self) -> None:
        self._proc.join(timeout=10)
        _stop_all(self._procs)
        self._out.close(linger=0)
        self._in.close(linger=0)
        self._zmq.term()

    @property
    def is_alive(self) -> bool:
        return not self.closed and self.fatal is None and first_dead(self._procs) is None

    @property
    def rank_pids(self) -> dict[str, int]:
        """This node's rank processes (rank, as a JSON key -> pid)."""
        return {str(p.rank): p.pid for p in self._procs}

    # ------------------------------------------------------------------ receiving

    def _receive_loop(self) -> None:
        poller = zmq.Poller()
        poller.register(self._in, zmq.POLLIN)
        while not self.closed:
            try:
                ready = poller.poll(200)
            except zmq.ZMQError:
                return
            if not ready:
                dead = first_dead(self._procs)
                if dead is not None and not (self.closed or self._stopping):
                    self.fatal = f"{_name(dead)} died (exit code {dead.exitcode})"
                    logger.error(self.fatal)
                    self._fail_all(self.fatal)
                    _stop_all(self._procs)  # a group without one of its ranks cannot run a step
                    return
                continue
            try:
                msg = pickle.loads(self._in.recv())
            except zmq.ZMQError:
                return
            try:
                self._dispatch(msg)
            except Exception:  # noqa: BLE001 - one bad message must not stop the thread every request waits on
                logger.exception("the engine could not handle a message from the scheduler")

    def _dispatch(self, msg) -> None:
        match msg:
            case ReqOutput():
                self._on_output(msg)
            case ControlReply(reply_id=rid, payload=payload):
                waiter = self._replies.pop(rid, None)
                if waiter is not None:
                    waiter[1].append(payload)
                    waiter[0].set()
            case FatalError(message=message):
                self.fatal = f"the scheduler process failed:\n{message}"
                logger.error(self.fatal)
                self._fail_all(self.fatal)
                if len(self._procs) > 1:  # the group is down: stop the ranks still waiting on it
                    threading.Thread(target=_stop_all, args=(self._procs,), daemon=True).start()

    def _on_output(self, msg: ReqOutput) -> None:
        if msg.duplicate:  # the scheduler refused a second request under a rid in flight: not about that one
            logger.warning("the scheduler refused a duplicate of request %s", msg.rid)
            return
        state = self._states.get(msg.rid)
        if state is None:
            return
        if msg.finish_reason is not None:  # the scheduler is done with this rid: it is free again
            with self._lock:
                if self._states.get(msg.rid) is state:
                    del self._states[msg.rid]
        if state.finished:  # failed on this side earlier; this was the scheduler's last word on it
            return
        try:
            state.apply(msg)
        except Exception as e:  # noqa: BLE001 - e.g. the tokenizer fails on these ids: this request alone ends
            logger.exception("request %s: its output could not be processed", msg.rid)
            state.fail(f"request {msg.rid!r} failed: its output could not be detokenized "
                       f"({type(e).__name__}: {e})", status_code=500)
            if msg.finish_reason is None:  # the scheduler still runs it: free its KV there; the rid stays
                self._abort_quietly(msg.rid)  # registered until the scheduler reports the abort
        if state.notify is not None:
            state.notify()

    def _abort_quietly(self, rid: str) -> None:
        try:
            self.send(AbortRequest(rid))
        except Exception:  # noqa: BLE001 - the engine is going down; the request is ended on this side
            logger.warning("could not abort %s in the scheduler", rid)

    def _fail_all(self, message: str) -> None:
        with self._lock:
            states = list(self._states.values())
            self._states.clear()
        for state in states:
            state.fail(message, fatal=True)
            if state.notify is not None:
                state.notify()
        for event, _ in list(self._replies.values()):
            event.set()

    # ------------------------------------------------------------------ sending

    def send(self, msg) -> None:
        if self.closed:
            raise RuntimeError("the engine is shut down")
        if self.fatal is not None:
            raise RuntimeError(self.fatal)
        data = pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL)
        with self._send_lock:  # zmq sockets are not thread-safe
            while True:
                try:  # never block: a dead scheduler would hang the caller (and a server's event loop)
                    self._out.send(data, zmq.NOBLOCK)
                    return
                except zmq.Again:
                    if first_dead(self._procs) is not None:
                        self.fatal = self.fatal or "the scheduler process died"
                        raise RuntimeError(self.fatal) from None
                    time.sleep(0.001)

    def control(self, kind: str, timeout: float = 60.0):
        """Send a control request and wait for its reply."""
        return self.call(lambda reply_id: ControlRequest(reply_id, kind), kind, timeout)

    def call(self, make_message, what: str, timeout: float = 60.0):
        """Send make_message(reply_id) (a message answered by a ControlReply) and wait for the reply's payload."""
        reply_id = next(self._reply_ids)
        event, box = threading.Event(), []
        self._replies[reply_id] = (event, box)
        self.send(make_message(reply_id))
        if not event.wait(timeout) or not box:
            self._replies.pop(reply_id, None)
            raise RuntimeError(self.fatal or f"no answer from the scheduler to {what!r}")
        return box[0]

    def submit(self, base: str, reqs: list[GenerateRequest], states: list[RequestState]) -> None:
        """Register the states, then send the requests. A rid already in flight is refused (RequestError)
        before anything is registered or sent, so the request that holds it keeps running undisturbed."""
        with self._lock:
            taken = [r.rid for r in reqs if r.rid in self._states]
            if base in self._groups or (len(reqs) > 1 and base in self._states):
                taken.insert(0, base)
            if taken:
                raise RequestError(f"rid: request id {taken[0]!r} is already in use by a running request")
            for st in states:
                self._states[st.rid] = st
            if len(reqs) > 1:
                self._groups[base] = [r.rid for r in reqs]
        try:
            for r in reqs:
                self.send(r)
        except Exception:
            with self._lock:
                for st in states:
                    if self._states.get(st.rid) is st:
                        del self._states[st.rid]
                self._groups.pop(base, None)
            raise

    async def run_group(self, base: str, reqs: list[GenerateRequest], states: list[RequestState]) -> None:
        """Submit `reqs` and wait (on the running event loop) until every one of `states` has finished; a cancelled
        caller aborts them. The group ends either way."""
        loop = asyncio.get_running_loop()
        futures = []
        for st in states:
            fut = loop.create_future()

            def done(fut=fut, st=st):
                if st.finished and not fut.done():
                    fut.set_result(None)

            st.notify = lambda done=done: call_soon(loop, done)
            futures.append(fut)
        self.submit(base, reqs, states)
        try:
            await asyncio.gather(*futures)
        except asyncio.CancelledError:
            self.abort(base)
            raise
        finally:
            self.end_group(base)

    def end_group(self, base: str) -> None:
        """The generate call that made `base`'s requests has returned."""
        self._groups.pop(base, None)

    def abort(self, rid: str) -> None:
        """Abort a request in flight (or every request made from one caller's rid)."""
        for sub in self._groups.get(rid, [rid]):
            if sub in self._states and not self.closed and self.fatal is None:
                self.send(AbortRequest(sub))


def call_soon(loop: asyncio.AbstractEventLoop, fn, *args) -> None:
    """Wake an asyncio waiter from the receiver thread; a loop that is already closed has no waiter."""
    try:
        loop.call_soon_threadsafe(fn, *args)
    except RuntimeError:
        pass


def _name(proc: RankProcess) -> str:
    return "the scheduler process" if proc.rank == 0 else f"rank {proc.rank}"


def _stop_all(procs: list[RankProcess]) -> None:
    for p in procs:
        p.stop()
