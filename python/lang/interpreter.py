"""The interpreter: a program state's text and variables, and how each IR node changes them.

`execute(core, node)` is a generator: it yields the backend calls a node needs (`Generate`,
`Score`, `Wait`) and receives their results, so one interpreter serves two drivers: a worker
thread per state that calls the backend synchronously, and an asyncio task per state that awaits
it (`arun`). Nodes queued on a state run one at a time, in order; `s += gen(...)` returns at once.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import threading
from collections import Counter, deque
from collections.abc import Callable, Generator
from dataclasses import dataclass
from typing import Any, NamedTuple

from radixgen.lang.backend_base import PREFILL_ONLY, BaseBackend, ChatContext, GenRequest, ScoredChoices
from radixgen.lang.chat import RoleFrame
from radixgen.lang.choices import decide
from radixgen.lang.ir import (
    Fork,
    Gen,
    Join,
    Node,
    RoleBegin,
    RoleEnd,
    Select,
    Seq,
    SetVar,
    Text,
    VarScopeBegin,
    VarScopeEnd,
)

LANG_DIR = os.path.dirname(os.path.abspath(__file__))

# dtype -> (regex the value must match, conversion of the generated text)
DTYPE_RULES: dict[str, tuple[str, Callable[[str], Any]]] = {
    "int": (r" ?-?(0|[1-9][0-9]{0,17})", lambda t: int(t.strip())),
    "float": (r" ?-?(0|[1-9][0-9]{0,15})(\.[0-9]{1,15})?", lambda t: float(t.strip())),
    "bool": (r" ?(True|False)", lambda t: t.strip() == "True"),
    "str": (r' ?"[^"\\\n]*"', lambda t: json.loads(t.strip())),
}


# ---------------------------------------------------------------------------------------------
# Errors that remember the program line


class Origin(NamedTuple):
    filename: str
    lineno: int
    function: str
    code: str

    def __str__(self) -> str:
        return f"{self.filename}:{self.lineno} in {self.function}: {self.code}"


def caller_origin() -> Origin | None:
    """The first frame outside radixgen.lang: the program line that appended the expression."""
    import linecache

    frame = sys._getframe(1)
    while frame is not None and os.path.dirname(os.path.abspath(frame.f_code.co_filename)) == LANG_DIR:
        frame = frame.f_back
    if frame is None:
        return None
    filename, lineno = frame.f_code.co_filename, frame.f_lineno
    return Origin(filename, lineno, frame.f_code.co_name, linecache.getline(filename, lineno).strip())


class ProgramError(RuntimeError):
    """An exception raised while running an expression, with the program line that appended it."""

    def __init__(self, error: BaseException, origin: Origin | None):
        self.error = error
        self.origin = origin
        where = f"\n  at program line {origin}" if origin else ""
        super().__init__(f"{type(error).__name__}: {error}{where}")


# ---------------------------------------------------------------------------------------------
# Waiting, for threads and coroutines alike


class Notifier:
    """Wakes waiters when the state changes: threads block on a Condition, coroutines await a
    future resolved on their own loop (thread-safe, so a thread may wake a coroutine)."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._futures: list[tuple[asyncio.AbstractEventLoop, asyncio.Future]] = []

    def bump(self) -> None:
        with self._cond:
            self._cond.notify_all()
            futures, self._futures = self._futures, []
        for loop, fut in futures:
            try:
                loop.call_soon_threadsafe(_resolve, fut)
            except RuntimeError:  # the loop is closed: nobody is waiting any more
                pass

    def wait(self, pred: Callable[[], bool]) -> None:
        with self._cond:
            self._cond.wait_for(pred)

    async def wait_async(self, pred: Callable[[], bool]) -> None:
        loop = asyncio.get_running_loop()
        while True:
            with self._cond:
                if pred():
                    return
                fut = loop.create_future()
                self._futures.append((loop, fut))
            await fut


def _resolve(fut: asyncio.Future) -> None:
    if not fut.done():
        fut.set_result(None)


# ---------------------------------------------------------------------------------------------
# Calls the interpreter yields to its driver


class Generate(NamedTuple):
    requests: list[GenRequest]
    on_chunk: Callable[[dict], None] | None = None  # set: stream the single request


class Score(NamedTuple):
    prompt: str
    choices: list[str]
    unconditional: str | None


class Wait(NamedTuple):
    notifier: Notifier
    pred: Callable[[], bool]


# ---------------------------------------------------------------------------------------------
# The state


@dataclass(frozen=True)
class SamplingDefaults:
    """The run's defaults; a gen's own arguments override them."""

    max_new_tokens: int = 128
    min_new_tokens: int = 0
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    stop_regex: str | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    ignore_eos: bool = False
    return_logprob: bool | None = None
    logprob_start_len: int | None = None
    top_logprobs_num: int | None = None
    return_text_in_logprobs: bool | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "stop", (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ()))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids or ()))


class OpenRole(NamedTuple):
    role: str
    frame: RoleFrame
    content_start: int  # index in the text where the turn's content begins
    stop_token_id: int | None  # the end-of-turn marker as one token, when it is one


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
        if mode not in ("thread", "async", "trace"):
            raise ValueError(f"mode: {mode!r}")
        self.backend = backend
        self.defaults = defaults
        self.stream = stream
        self.mode = mode
        self.loop: asyncio.AbstractEventLoop | None = None
        self.text = ""
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
        self.fork_messages = 0
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
            self.queue.append((node, origin, names))
            self.pending += names
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
        child = StateCore(self.backend, self.defaults, stream=self.stream, mode=self.mode)
        child.ready = False
        self.children.append(child)
        start_driver(child, self.loop)
        return child


# ---------------------------------------------------------------------------------------------
# What each node does


def execute(core: StateCore, node: Node) -> Generator[Any, Any, None]:
    match node:
        case Seq(items):
            for item in items:
                yield from execute(core, item)
        case Text(value):
            core.append(value)
        case Gen():
            yield from execute_gen(core, node)
        case Select():
            yield from execute_select(core, node)
        case RoleBegin(role):
            begin_role(core, role)
        case RoleEnd(role):
            end_role(core, role)
        case VarScopeBegin(name):
            core.scopes.append((name, len(core.text)))
        case VarScopeEnd(name):
            if not core.scopes or core.scopes[-1][0] != name:
                raise ValueError(f"var_scope {name!r} ends but it is not the innermost open scope")
            _, start = core.scopes.pop()
            core.set_var(name, core.text[start:])
        case SetVar(name, value):
            core.set_var(name, value)
        case Fork(children):
            yield from execute_fork(core, children)
        case Join(children, mode):
            yield from execute_join(core, children, mode)
        case _:
            raise TypeError(f"unknown expression {node!r}")


def begin_role(core: StateCore, role: str) -> None:
    if core.role is not None:
        raise ValueError(f"cannot begin a {role!r} turn inside the open {core.role.role!r} turn")
    frame = core.backend.chat_template.frame(core.messages, role)
    core.append(frame.prefix)
    stop_id = core.backend.single_token_id(frame.end_of_turn) if frame.end_of_turn else None
    core.role = OpenRole(role, frame, len(core.text), stop_id)


def end_role(core: StateCore, role: str) -> None:
    if core.role is None or core.role.role != role:
        opened = core.role.role if core.role else None
        raise ValueError(f"cannot end a {role!r} turn: the open turn is {opened!r}")
    content = core.text[core.role.content_start :]
    suffix = core.backend.chat_template.closing(core.messages, role, content, core.role.frame)
    core.append(suffix)
    core.messages.append({"role": role, "content": content})
    core.role = None


def gen_request(core: StateCore, node: Gen) -> GenRequest:
    d = core.defaults
    params: dict[str, Any] = {
        "max_new_tokens": d.max_new_tokens,
        "min_new_tokens": d.min_new_tokens,
        "stop": list(d.stop),
        "stop_token_ids": list(d.stop_token_ids),
        "temperature": d.temperature,
        "top_p": d.top_p,
        "top_k": d.top_k,
        "min_p": d.min_p,
        "frequency_penalty": d.frequency_penalty,
        "presence_penalty": d.presence_penalty,
        "ignore_eos": d.ignore_eos,
    }
    if d.stop_regex is not None:
        params["stop_regex"] = d.stop_regex
    for key, value in node.sampling_overrides().items():
        params[key] = list(value) if isinstance(value, tuple) else value
    if core.role is not None and not core.backend.is_chat_model:
        # The turn's end marker ends the gen, so the text stays a well-formed conversation. As a
        # token id when it is one token: a stop string would hold back streamed text.
        marker, token = core.role.frame.end_of_turn, core.role.stop_token_id
        if token is not None and token not in params["stop_token_ids"]:
            params["stop_token_ids"].append(token)
        elif token is None and marker and marker not in params["stop"]:
            params["stop"].append(marker)
    if node.n > 1:
        params["n"] = node.n
    if node.regex is not None:
        params["regex"] = node.regex
    elif node.json_schema is not None:
        params["json_schema"] = node.json_schema
    elif node.dtype is not None:
        params["regex"] = DTYPE_RULES[node.dtype][0]
    return_logprob = _pick(node.return_logprob, d.return_logprob, False)
    text_in_logprobs = _pick(node.return_text_in_logprobs, d.return_text_in_logprobs, False)
    chat = None
    if core.backend.is_chat_model:
        partial = core.text[core.role.content_start :] if core.role else ""
        chat = ChatContext(list(core.messages), core.role.role if core.role else None, partial)
    return GenRequest(
        text=core.text,
        input_ids=None,
        sampling_params=params,
        return_logprob=return_logprob,
        logprob_start_len=_pick(node.logprob_start_len, d.logprob_start_len, -1) if return_logprob else -1,
        top_logprobs_num=_pick(node.top_logprobs_num, d.top_logprobs_num, 0) if return_logprob else 0,
        return_text_in_logprobs=bool(return_logprob and text_in_logprobs),
        chat=chat,
    )


def _pick(*values: Any) -> Any:
    return next(v for v in values if v is not None)


def execute_gen(core: StateCore, node: Gen) -> Generator[Any, Any, None]:
    request = gen_request(core, node)
    tags = frozenset([node.name]) if node.name else frozenset()
    if core.stream and node.n == 1:
        start = len(core.text)

        def on_chunk(chunk: dict) -> None:
            delta = chunk.get("delta")
            if delta is None:  # a backend without deltas: derive them from the cumulative text
                delta = chunk["text"][len(core.text) - start :]
            core.append(delta, tags, chunk.get("meta_info"))

        [result] = yield Generate([request], on_chunk)
        if core.text[start:] != result["text"]:  # keep the final text authoritative
            core.text = core.text[:start] + result["text"]
        texts, metas = [result["text"]], result["meta_info"]
    else:
        [result] = yield Generate([request])
        results = result if node.n > 1 else [result]
        texts = [r["text"] for r in results]
        metas = [r["meta_info"] for r in results] if node.n > 1 else results[0]["meta_info"]
        core.append(texts[0], tags, results[0]["meta_info"])
    core.cached_len = len(core.text)  # prompt and output are in the cache now
    values = [convert(node, t, m) for t, m in zip(texts, metas if node.n > 1 else [metas], strict=True)]
    if node.name:
        core.set_var(node.name, values if node.n > 1 else values[0], metas)


def convert(node: Gen, text: str, meta: dict) -> Any:
    if node.dtype is None:
        return text
    try:
        return DTYPE_RULES[node.dtype][1](text)
    except ValueError as e:
        reason = (meta or {}).get("finish_reason")
        raise ValueError(
            f"gen {node.name!r}: dtype={node.dtype} but the model wrote {text!r} (finish_reason {reason})"
        ) from e


def execute_select(core: StateCore, node: Select) -> Generator[Any, Any, None]:
    unconditional = None
    if getattr(node.method, "requires_unconditional_logprobs", False):
        # "No context": just the turn's header when inside a turn, else the BOS/EOS token.
        unconditional = core.role.frame.prefix if core.role else core.backend.unconditional_prompt()
    scored: ScoredChoices = yield Score(core.text, list(node.choices), unconditional)
    decision = decide(
        node.method,
        list(node.choices),
        scored.input_token_logprobs,
        scored.unconditional_token_logprobs,
        node.temperature,
    )
    tags = frozenset([node.name]) if node.name else frozenset()
    core.append(decision.decision, tags)
    core.cached_len = len(core.text)  # every choice was prefilled after the text
    if node.name:
        core.set_var(node.name, decision.decision, decision.meta_info)


def execute_fork(core: StateCore, children: tuple[StateCore, ...]) -> Generator[Any, Any, None]:
    if len(core.text) > core.cached_len and core.backend.can_prefill:
        # Cache the shared prefix once, so the branches' requests all start from a cache hit
        # (not needed when the text is what the last request read or wrote: that is cached).
        yield Generate([GenRequest(core.text, None, dict(PREFILL_ONLY))])
        core.cached_len = len(core.text)
    for child in children:
        child.init_from(core)


def execute_join(core: StateCore, children: tuple[StateCore, ...], mode: str) -> Generator[Any, Any, None]:
    if mode not in ("gather_variable", "concate_and_append"):
        raise ValueError(f"join.mode: must be 'gather_variable' or 'concate_and_append' (got {mode!r})")
    for child in children:
        yield Wait(child.changed, lambda child=child: child.idle)
    for child in children:
        if child.error is not None:
            raise child.error
    if mode == "gather_variable":
        names = [n for n in dict.fromkeys(n for c in children for n in sorted(c.assigned))]
        for name in names:
            metas = [c.meta_info.get(name) for c in children]
            core.set_var(name, [c.variables.get(name) for c in children], metas)
    else:
        core.append("".join(c.text[c.fork_start :] for c in children))
        for c in children:
            core.messages.extend(c.messages[c.fork_messages :])


# ---------------------------------------------------------------------------------------------
# Drivers


def run_item_sync(core: StateCore, node: Node, origin: Origin | None) -> None:
    steps = execute(core, node)
    result = None
    try:
        while True:
            call = steps.send(result)
            result = perform_sync(core, call)
    except StopIteration:
        pass
    except BaseException as e:  # noqa: BLE001 - every failure is reported with its program line
        core.fail(e, origin)


def perform_sync(core: StateCore, call: Any) -> Any:
    match call:
        case Generate(requests, None):
            return core.backend.generate(requests)
        case Generate([request], on_chunk):
            last = None
            for chunk in core.backend.generate_stream(request):
                on_chunk(chunk)
                last = chunk
            return [last]
        case Score(prompt, choices, unconditional):
            return core.backend.score_choices(prompt, choices, unconditional)
        case Wait(notifier, pred):
            notifier.wait(pred)
            return None
    raise TypeError(f"unknown call {call!r}")


async def run_item_async(core: StateCore, node: Node, origin: Origin | None) -> None:
    steps = execute(core, node)
    result = None
    try:
        while True:
            call = steps.send(result)
            result = await perform_async(core, call)
    except StopIteration:
        pass
    except BaseException as e:  # noqa: BLE001
        if isinstance(e, asyncio.CancelledError):
            core.fail(RuntimeError("the program was cancelled"), origin)
            raise
        core.fail(e, origin)


async def perform_async(core: StateCore, call: Any) -> Any:
    match call:
        case Generate(requests, None):
            return await core.backend.agenerate(requests)
        case Generate([request], on_chunk):
            last = None
            async for chunk in core.backend.agenerate_stream(request):
                on_chunk(chunk)
                last = chunk
            return [last]
        case Score(prompt, choices, unconditional):
            return await core.backend.ascore_choices(prompt, choices, unconditional)
        case Wait(notifier, pred):
            await notifier.wait_async(pred)
            return None
    raise TypeError(f"unknown call {call!r}")


def _thread_main(core: StateCore) -> None:
    while True:
        core.changed.wait(lambda: core.has_work() or core.exhausted())
        item = core.take()
        if item is None:
            return
        node, origin, names = item
        run_item_sync(core, node, origin)
        core.item_done(names)


async def _task_main(core: StateCore) -> None:
    while True:
        await core.changed.wait_async(lambda: core.has_work() or core.exhausted())
        item = core.take()
        if item is None:
            return
        node, origin, names = item
        await run_item_async(core, node, origin)
        core.item_done(names)


# Strong references to running driver tasks: the loop keeps only weak ones.
_TASKS: set[asyncio.Task] = set()


def start_driver(core: StateCore, loop: asyncio.AbstractEventLoop | None = None) -> None:
    match core.mode:
        case "thread":
            threading.Thread(target=_thread_main, args=(core,), daemon=True, name="radixgen-program").start()
        case "async":
            core.loop = loop or asyncio.get_running_loop()
            task = core.loop.create_task(_task_main(core))
            _TASKS.add(task)
            task.add_done_callback(_TASKS.discard)
        case "trace":
            pass


# ---------------------------------------------------------------------------------------------
# Tracing: run a program without the model, up to its first model call


class TraceStop(Exception):
    """Raised into a traced program at its first model call (or its first read of a value)."""


def run_traced(core: StateCore, node: Node) -> None:
    steps = execute(core, node)
    try:
        next(steps)
    except StopIteration:
        return
    raise TraceStop
