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
import os
import pickle
import subprocess
import sys
import tempfile
import threading
import time
import weakref

import zmq

from radixgen.runtime.config import RuntimeConfig
from radixgen.runtime.messages import (
    AbortRequest,
    ControlReply,
    ControlRequest,
    FatalError,
    GenerateRequest,
    ReadySignal,
    ReqOutput,
)
from radixgen.runtime.request_state import RequestError, RequestState

logger = logging.getLogger(__name__)

START_TIMEOUT_S = 600.0


class SchedulerClient:
    """Owns the scheduler process, the two zmq sockets and the receiver thread. `ready` is the scheduler's
    ready signal (sizes of the model and the KV pool)."""

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
        # a fresh interpreter (not multiprocessing's spawn), so the caller's script is never re-imported
        args_file = os.path.join(ipc, "args.pkl")
        with open(args_file, "wb") as f:
            pickle.dump((config, to_sched, from_sched, model_path), f)
        self._proc = _SchedulerProcess(args_file)
        self._finalizer = weakref.finalize(self, _kill, self._proc)
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
            elif not self._proc.is_alive():
                raise RuntimeError(f"the scheduler process exited during start (code {self._proc.exitcode})")
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
        _kill(self._proc)
        self._out.close(linger=0)
        self._in.close(linger=0)
        self._zmq.term()

    @property
    def is_alive(self) -> bool:
        return not self.closed and self.fatal is None and self._proc.is_alive()

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
                if not self._proc.is_alive() and not (self.closed or self._stopping):
                    self.fatal = f"the scheduler process died (exit code {self._proc.exitcode})"
                    logger.error(self.fatal)
                    self._fail_all(self.fatal)
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
                    if not self._proc.is_alive():
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

    def end_group(self, base: str) -> None:
        """The generate call that made `base`'s requests has returned."""
        self._groups.pop(base, None)

    def abort(self, rid: str) -> None:
        """Abort a request in flight (or every request made from one caller's rid)."""
        for sub in self._groups.get(rid, [rid]):
            if sub in self._states and not self.closed and self.fatal is None:
                self.send(AbortRequest(sub))


class _SchedulerProcess:
    """`python -m radixgen.runtime.scheduler ARGS_FILE` as a child process."""

    def __init__(self, args_file: str) -> None:
        # torch backs its large CPU allocations (weights, KV pool) with transparent huge pages when this is set
        # before its first allocation: fewer TLB misses while decode streams the weights (about 3% at batch 1)
        env = {"THP_MEM_ALLOC_ENABLE": "1", **os.environ}
        self.popen = subprocess.Popen([sys.executable, "-m", "radixgen.runtime.scheduler", args_file],
                                      stdin=subprocess.DEVNULL, env=env)

    def is_alive(self) -> bool:
        return self.popen.poll() is None

    @property
    def exitcode(self) -> int | None:
        return self.popen.poll()

    def join(self, timeout: float | None = None) -> None:
        try:
            self.popen.wait(timeout)
        except subprocess.TimeoutExpired:
            pass

    def terminate(self) -> None:
        self.popen.terminate()

    def kill(self) -> None:
        self.popen.kill()


def call_soon(loop: asyncio.AbstractEventLoop, fn, *args) -> None:
    """Wake an asyncio waiter from the receiver thread; a loop that is already closed has no waiter."""
    try:
        loop.call_soon_threadsafe(fn, *args)
    except RuntimeError:
        pass


def _kill(proc: _SchedulerProcess) -> None:
    if proc.is_alive():
        proc.terminate()
        proc.join(timeout=5)
    if proc.is_alive():
        proc.kill()
        proc.join(timeout=5)
