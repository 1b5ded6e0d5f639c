"""The shared state of one program (or one fork): text, turns, variables, and the queue of
expressions still to run."""

from __future__ import annotations

import asyncio
import threading
from collections import Counter, deque
from dataclasses import dataclass
from typing import Any, NamedTuple

from radixgen.common.lora_names import check_lora_name
from radixgen.common.sampling_params import check_param, default_of
from radixgen.lang.backend_base import BaseBackend
from radixgen.lang.interpreter.drivers import run_item_sync, start_driver
from radixgen.lang.interpreter.errors import Origin, ProgramError
from radixgen.lang.interpreter.execute import OpenRole, run_traced
from radixgen.lang.interpreter.notifier import Notifier
from radixgen.lang.ir import SAMPLING_FIELDS, Gen, Join, Node, Select, Seq, SetVar, VarScopeEnd, with_declared_fields

# thread: a worker thread runs the queue; inline: `s += x` runs x in the caller's thread (run(use_thread=False));
# async: a task on the event loop runs the queue; trace: run without the model up to its first call.
MODES = ("thread", "inline", "async", "trace")


def _run_default(name: str) -> Any:
    """A declared default as a run holds it (a frozen record: lists become tuples)."""
    value = default_of(name)
    return tuple(value) if isinstance(value, list) else value


@dataclass(frozen=True)
@with_declared_fields((*SAMPLING_FIELDS, "n"), default=_run_default)
class SamplingDefaults:
    """The run's defaults: a field per declared parameter a gen passes through, and n (their declared
    defaults, radixgen.common.sampling_params); a gen's own arguments override them."""

    return_logprob: bool | None = None
    logprob_start_len: int | None = None
    top_logprobs_num: int | None = None
    return_text_in_logprobs: bool | None = None
    lora_name: str | None = None  # the LoRA adapter of every request the run sends, by name (None: the base model)

    def __post_init__(self) -> None:
        object.__setattr__(self, "stop", (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ()))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids or ()))
        if isinstance(self.stop_regex, (list, tuple)):  # SGLang's run takes a list; [] means none
            if len(self.stop_regex) > 1:
                raise ValueError("run.stop_regex: one regular expression (combine several with |)")
            object.__setattr__(self, "stop_regex", self.stop_regex[0] if self.stop_regex else None)
        check_param("n", self.n, "run")
        check_lora_name(self.lora_name, "run.lora_name")


class LogEntry(NamedTuple):
    """One step of the text, for streaming: a delta tagged with the variables it belongs to."""

    text: str
    tags: frozenset[str]
    meta: dict | None = None
    done: str | None = None  # a variable that is complete at this point


WILDCARD = "*"  # a queued join may set any variable


def produced_names(node: Node) -> Counter:
    match node:
        case Seq(items):
            total: Counter = Counter()
            for item in items:
                total += produced_names(item)
            return total
        case Gen(name=name) | Select(name=name) | VarScopeEnd(name=name) | SetVar(name=name) if name:
            return Counter([name])
        case Join():
            return Counter([WILDCARD])
        case _:
            return Counter()


class StateCore:
    """The shared state of one program (or one fork): text, turns, variables, queue."""

    def __init__(self, backend: BaseBackend, defaults: SamplingDefaults, *, stream: bool, mode: str):
        if mode not in MODES:
            raise ValueError(f"mode: {mode!r}")
        self.backend = backend
        self.defaults = defaults
        self.stream = stream
        self.mode = mode
        self.loop: asyncio.AbstractEventLoop | None = None
        self.text = ""
        self.images: list[Any] = []  # the sources of the images whose placeholders the text holds, in order
        self.messages: list[dict[str, str]] = []
        self.variables: dict[str, Any] = {}
        self.meta_info: dict[str, Any] = {}
        self.role: OpenRole | None = None
        self.scopes: list[tuple[str, int]] = []
        self.log: list[LogEntry] = []
        self.queue: deque[tuple[Node, Origin | None, Counter]] = deque()
        self.pending: Counter = Counter()  # variable names that queued items will set
        self.busy = False
        self.closed = False
        self.ready = True  # False for a fork until its parent reaches the fork point
        self.error: ProgramError | None = None
        self.children: list[StateCore] = []
        self.cached_len = 0  # text[:cached_len] was the prompt or output of a request: it is in the cache
        self.fork_start = 0  # for forks: where the parent's text ended
        self.fork_messages = self.fork_images = 0
        self.assigned: set[str] = set()  # variables set since the fork
        self.changed = Notifier()
        self._lock = threading.Lock()

    # ---- queue
    def submit(self, node: Node, origin: Origin | None) -> None:
        if self.mode == "trace":
            return run_traced(self, node)
        names = produced_names(node)
        with self._lock:
            if self.closed:
                raise RuntimeError("the program has finished; nothing more can be appended to its state")
            if self.error is not None:
                return  # the program already failed; run / error() report it
            if self.mode == "inline":
                self.busy = True
            else:
                self.queue.append((node, origin, names))
                self.pending += names
        if self.mode == "inline":
            run_item_sync(self, node, origin)
            self.item_done(Counter())
            return
        self.changed.bump()

    def take(self) -> tuple[Node, Origin | None, Counter] | None:
        """The next item to run (marking the state busy), or None once closed and drained."""
        with self._lock:
            if not self.queue:
                return None
            self.busy = True
            return self.queue.popleft()

    def item_done(self, names: Counter) -> None:
        with self._lock:
            self.busy = False
            self.pending -= names
        self.changed.bump()

    def has_work(self) -> bool:
        return bool(self.queue) and self.ready

    def exhausted(self) -> bool:
        return self.closed and not self.queue

    @property
    def idle(self) -> bool:
        return self.error is not None or (self.ready and not self.queue and not self.busy)

    @property
    def finished(self) -> bool:
        return self.closed and self.idle

    def settled(self, name: str) -> bool:
        """No queued expression will (re)set `name`."""
        return self.error is not None or (self.ready and not self.pending[name] and not self.pending[WILDCARD])

    def close(self) -> None:
        with self._lock:
            self.closed = True
        self.changed.bump()
        for child in self.children:
            child.close()

    def fail(self, error: BaseException, origin: Origin | None) -> None:
        err = error if isinstance(error, ProgramError) else ProgramError(error, origin)
        with self._lock:
            if self.error is None:
                self.error = err
            self.queue.clear()
            self.pending.clear()
            self.ready = True
        self.changed.bump()
        for child in self.children:
            if not child.ready:
                child.fail(RuntimeError("the parent program failed before the fork point"), origin)

    # ---- text and variables
    def append(self, text: str, tags: frozenset[str] = frozenset(), meta: dict | None = None) -> None:
        if not text:
            return
        self.text += text
        self.log.append(LogEntry(text, tags | self.scope_names(), meta))
        self.changed.bump()

    def scope_names(self) -> frozenset[str]:
        return frozenset(name for name, _ in self.scopes)

    def set_var(self, name: str, value: Any, meta: Any = None) -> None:
        self.variables[name] = value
        if meta is not None:
            self.meta_info[name] = meta
        self.assigned.add(name)
        self.log.append(LogEntry("", frozenset(), None, done=name))
        self.changed.bump()

    def init_from(self, parent: StateCore) -> None:
        """Become a copy of `parent` as it is now (at the fork point)."""
        self.text = parent.text
        self.images = list(parent.images)  # a fork keeps the image prefix
        self.fork_images = len(parent.images)
        self.messages = list(parent.messages)
        self.variables = dict(parent.variables)
        self.meta_info = dict(parent.meta_info)
        self.role = parent.role
        self.scopes = list(parent.scopes)
        self.fork_start = len(parent.text)
        self.fork_messages = len(parent.messages)
        self.cached_len = parent.cached_len
        if parent.text:
            self.log.append(LogEntry(parent.text, frozenset(), None))
        with self._lock:
            self.ready = True
        self.changed.bump()

    def spawn(self) -> StateCore:
        # The branches of an inline program still run in threads of their own: they run side by side.
        mode = "thread" if self.mode == "inline" else self.mode
        child = StateCore(self.backend, self.defaults, stream=self.stream, mode=mode)
        child.ready = False
        self.children.append(child)
        start_driver(child, self.loop)
        return child
