"""What a program body sees as `s`: `ProgramState`, and `ProgramStateGroup` for forks."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

from radixgen.lang.interpreter import (
    ProgramError,
    StateCore,
    TraceStop,
    caller_origin,
)
from radixgen.lang.ir import (
    Fork,
    Join,
    Node,
    RoleBegin,
    RoleEnd,
    Seq,
    SetVar,
    VarScopeBegin,
    VarScopeEnd,
    as_node,
)


class ProgramState:
    """The state of a running program. `s += expr` queues `expr` and returns at once; reads
    (`s["x"]`, `s.text()`) wait until the queued expressions they depend on have run."""

    def __init__(self, core: StateCore):
        self._core = core
        self.ret_value: Any = None
        self._copy_group: ProgramStateGroup | None = None

    # ---- appending
    def __iadd__(self, other: Any) -> ProgramState:
        self._core.submit(as_node(other), caller_origin())
        return self

    def _submit(self, node: Node) -> None:
        self._core.submit(node, caller_origin())

    def set_var(self, name: str, value: Any) -> None:
        """Set a variable: queued after what is queued so far while the program runs; at once on a
        finished state (as SGLang allows: `state["n"] = int(state["n"])` after `run`)."""
        core = self._core
        if core.closed:
            self.sync()
            core.set_var(name, value)
            return
        self._submit(SetVar(name, value))

    __setitem__ = set_var

    @contextlib.contextmanager
    def var_scope(self, name: str) -> Iterator[None]:
        """Everything appended inside the block becomes the variable `name` too."""
        self._submit(VarScopeBegin(name))
        yield
        self._submit(VarScopeEnd(name))

    def role(self, role: str, expr: Any = None) -> Any:
        """With `expr`: append a whole turn. Without: a `with` block for the turn's content."""
        if expr is not None:
            self._submit(Seq.of(RoleBegin(role), expr, RoleEnd(role)))
            return None
        return self._role_block(role)

    @contextlib.contextmanager
    def _role_block(self, role: str) -> Iterator[None]:
        self._submit(RoleBegin(role))
        yield
        self._submit(RoleEnd(role))

    def system(self, expr: Any = None) -> Any:
        return self.role("system", expr)

    def user(self, expr: Any = None) -> Any:
        return self.role("user", expr)

    def assistant(self, expr: Any = None) -> Any:
        return self.role("assistant", expr)

    # ---- forks
    def fork(self, size: int = 1, position_ids_offset: Any = None) -> ProgramStateGroup:
        """`size` copies of this state as it will be once everything queued so far has run.
        The shared text is sent once as a prefill-only request first, so every branch hits the cache."""
        if position_ids_offset is not None:
            raise ValueError("fork.position_ids_offset: not supported by radixgen")
        if not isinstance(size, int) or isinstance(size, bool) or size < 1:
            raise ValueError(f"fork.size: must be a positive integer (got {size!r})")
        children = tuple(self._core.spawn() for _ in range(size))
        self._submit(Fork(children))
        return ProgramStateGroup([ProgramState(c) for c in children], self)

    def copy(self) -> ProgramState:
        """A fork of one branch. Also a `with` block (SGLang's form): `with s.copy() as c:` joins the
        branch's variables back into `s` (gather_variable) when the block ends."""
        group = self.fork(1)
        branch = group[0]
        branch._copy_group = group
        return branch

    def __enter__(self) -> ProgramState:
        if getattr(self, "_copy_group", None) is None:
            raise TypeError("only a state made by s.copy() is a `with` block")
        return self

    def __exit__(self, *exc: Any) -> None:
        self._copy_group.join()

    # ---- reading
    def _wait(self, pred: Callable[[], bool], what: str) -> None:
        core = self._core
        if pred():
            return
        if core.mode == "trace":
            raise TraceStop
        if core.mode == "async" and _on_loop(core.loop):
            raise RuntimeError(
                f"{what} is not ready and waiting for it would block the event loop: "
                "in an `async def` program use `await s.aget_var(name)` / `await s.atext()`"
            )
        core.changed.wait(pred)

    def get_var(self, name: str) -> Any:
        core = self._core
        self._wait(lambda: core.settled(name), f"s[{name!r}]")
        return self._read_var(name)

    __getitem__ = get_var

    def _read_var(self, name: str) -> Any:
        core = self._core
        if name in core.variables:
            return core.variables[name]
        if core.error is not None:
            raise ProgramError(core.error.error, core.error.origin) from core.error.error
        raise KeyError(f"the program has no variable {name!r} (known: {sorted(core.variables)})")

    def __contains__(self, name: str) -> bool:
        core = self._core
        self._wait(lambda: core.settled(name), f"s[{name!r}]")
        return name in core.variables

    def get_meta_info(self, name: str) -> Any:
        core = self._core
        self._wait(lambda: core.settled(name), f"meta info of {name!r}")
        self._read_var(name)
        return core.meta_info.get(name)

    def sync(self) -> None:
        """Wait until everything queued so far has run."""
        self._wait(lambda: self._core.idle, "the state")

    def text(self) -> str:
        self.sync()
        return self._core.text

    def messages(self) -> list[dict[str, str]]:
        self.sync()
        return [dict(m) for m in self._core.messages]

    def error(self) -> ProgramError | None:
        self.sync()
        return self._core.error

    @property
    def variables(self) -> dict[str, Any]:
        self.sync()
        return dict(self._core.variables)

    async def aget_var(self, name: str) -> Any:
        core = self._core
        await core.changed.wait_async(lambda: core.settled(name))
        return self._read_var(name)

    async def atext(self) -> str:
        await self._core.changed.wait_async(lambda: self._core.idle)
        return self._core.text

    # ---- streaming
    def text_iter(self, var_name: str | None = None) -> Iterator[str]:
        """Yield the text as it is produced: all of it, or only the pieces of variable `var_name`
        (ending when that variable is complete)."""
        for entry in self._entries(var_name):
            yield entry.text

    def _entries(self, var_name: str | None):
        core, i = self._core, 0
        while True:
            core.changed.wait(lambda i=i: len(core.log) > i or core.finished)
            while i < len(core.log):
                entry, i = core.log[i], i + 1
                if var_name is not None and entry.done == var_name:
                    return
                if entry.text and (var_name is None or var_name in entry.tags):
                    yield entry
            if core.finished and i == len(core.log):
                if core.error is not None:
                    raise core.error
                return

    async def text_async_iter(self, var_name: str | None = None, return_meta_data: bool = False) -> AsyncIterator[Any]:
        """`async for` twin of `text_iter`; with return_meta_data, yields (text, meta_info) pairs
        (meta_info is the backend's chunk meta, None for text the program wrote itself)."""
        core, i = self._core, 0
        while True:
            await core.changed.wait_async(lambda i=i: len(core.log) > i or core.finished)
            while i < len(core.log):
                entry, i = core.log[i], i + 1
                if var_name is not None and entry.done == var_name:
                    return
                if entry.text and (var_name is None or var_name in entry.tags):
                    yield (entry.text, entry.meta) if return_meta_data else entry.text
            if core.finished and i == len(core.log):
                if core.error is not None:
                    raise core.error
                return

    def __repr__(self) -> str:
        return f"ProgramState({self.text()!r})"


JOIN_MODES = ("gather_variable", "concate_and_append")


class ProgramStateGroup:
    """The branches of `s.fork(n)`: index them, append to all (`forks += expr` or
    `forks += lambda i: expr`), and `join()` them back into the parent."""

    def __init__(self, states: list[ProgramState], parent: ProgramState):
        self.states = states
        self.parent = parent

    def __getitem__(self, i: int) -> ProgramState:
        return self.states[i]

    def __setitem__(self, i: int, value: ProgramState) -> None:
        if value is not self.states[i]:  # `forks[i] += x` assigns the same state back
            raise TypeError("fork branches cannot be replaced")

    def __len__(self) -> int:
        return len(self.states)

    def __iter__(self) -> Iterator[ProgramState]:
        return iter(self.states)

    def __iadd__(self, other: Any) -> ProgramStateGroup:
        """`forks += expr` (the same for every branch), `forks += lambda i: expr`, or a list/tuple
        with one expression per branch."""
        origin = caller_origin()
        if isinstance(other, (list, tuple)) and len(other) != len(self.states):
            raise ValueError(f"fork +=: {len(other)} expressions for {len(self.states)} branches")
        for i, state in enumerate(self.states):
            if isinstance(other, (list, tuple)):
                expr = other[i]
            else:
                expr = other(i) if callable(other) and not isinstance(other, Node) else other
            state._core.submit(as_node(expr), origin)
        return self

    def join(self, mode: str = "gather_variable") -> None:
        """Merge the branches into the parent once they have run: `gather_variable` sets each
        variable the branches wrote to the list of their values; `concate_and_append` appends
        their new text, in order."""
        if mode not in JOIN_MODES:
            raise ValueError(f"join.mode: must be one of {JOIN_MODES} (got {mode!r})")
        self.parent._submit(Join(tuple(s._core for s in self.states), mode))


def _on_loop(loop: asyncio.AbstractEventLoop | None) -> bool:
    try:
        return asyncio.get_running_loop() is loop
    except RuntimeError:
        return False
