"""Compiling constraints: the front process's quick check, and the scheduler's compile cache with its time limit.

A compile that has not finished ``compile_timeout_s`` after its ``submit`` fails that request alone
(``result()`` raises). xgrammar cannot be interrupted, so the compile keeps its pool thread until done and
its result still lands in the cache for later requests. xgrammar releases the GIL while compiling (a Python
thread keeps running beside a compile), so compiles do not stall the scheduler loop.
"""

from __future__ import annotations

import json
import re
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from functools import lru_cache
from typing import NamedTuple

import xgrammar as xgr

from radixgen.common.constraint import CONSTRAINT_KINDS, Constraint
from radixgen.common.grammar.schema import ConstraintError, analyze_schema, parse_schema, report_unenforced


class CompiledConstraint(NamedTuple):
    kind: str
    text: str
    grammar: xgr.CompiledGrammar
    unenforced: tuple[str, ...]  # "<json pointer>: <why>" for json_schema, else ()



class CacheInfo(NamedTuple):
    hits: int
    misses: int
    entries: int


# ---------------------------------------------------------------- validation (no tokenizer needed)

_XGR_PREFIX = re.compile(r"^\[[\d:]+\] \S+?:\d+: ")


def clean_error(e: BaseException) -> str:
    """xgrammar's C++ errors carry a time stamp and source location; keep the message."""
    return _XGR_PREFIX.sub("", str(e).strip())


def choices_to_ebnf(choices_json: str) -> str:
    """A JSON list of strings -> ``root ::= "a" | "b"``; json.dumps escapes quotes, backslashes and
    control characters the same way xgrammar's EBNF string literals read them."""
    try:
        choices = json.loads(choices_json)
    except ValueError as e:
        raise ConstraintError(f"choices: not a JSON list of strings: {e}") from e
    if not isinstance(choices, list) or not choices or not all(isinstance(c, str) and c for c in choices):
        raise ConstraintError(f"choices: must be a non-empty list of non-empty strings, got {choices_json}")
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in dict.fromkeys(choices))



def check_constraint(kind: str, text: str, *, strict_json: bool = False) -> None:
    """Cheap front-process check: raises ConstraintError (a ValueError) naming the problem; warns with
    UnenforcedSchemaWarning for unenforced schema keywords when not strict."""
    if kind not in CONSTRAINT_KINDS:
        raise ConstraintError(f"constraint kind must be one of {CONSTRAINT_KINDS}, got {kind!r}")
    try:
        if kind == "json_schema":
            analysis = analyze_schema(parse_schema(text))
            report_unenforced(kind, analysis.unenforced, strict_json)  # warns on every request, not once
            _parse_once(kind, json.dumps(analysis.schema))
        else:
            _parse_once(kind, text)
    except ConstraintError:
        raise
    except Exception as e:  # noqa: BLE001 - xgrammar raises RuntimeError for every parse error
        raise ConstraintError(f"{kind}: {describe(kind)}: {clean_error(e)}") from e


# Why a cache: the same constraint comes with every request of a batch and every turn of a program; xgrammar
# parses each text once per process (a failed parse raises and is not cached).
@lru_cache(maxsize=1024)
def _parse_once(kind: str, text: str) -> None:
    if kind == "regex":
        xgr.Grammar.from_regex(text)
    elif kind == "ebnf":
        xgr.Grammar.from_ebnf(text)
    elif kind == "choices":
        xgr.Grammar.from_ebnf(choices_to_ebnf(text))
    else:
        xgr.Grammar.from_json_schema(text)


def describe(kind: str) -> str:
    return {"regex": "invalid regular expression", "ebnf": "invalid EBNF grammar",
            "choices": "cannot build the choices grammar", "json_schema": "invalid JSON schema"}[kind]


# xgrammar 0.2.9 writes length-bounded strings as repetitions of [^"\\\r\n], which lets raw control
# characters (tab, \x01, ...) into the JSON; JSON forbids them. Its own unbounded strings exclude \0-\x1f.
_BOUNDED_CHARS = re.compile(r'^(\S+_characters ::= \(\()\[\^\\"\\\\\\r\\n\](\)\))$', re.M)


def fix_bounded_strings(ebnf: str) -> str:
    return _BOUNDED_CHARS.sub(lambda m: m.group(1) + r'[^\0-\x1f\"\\\r\n]' + m.group(2), ebnf)


# ---------------------------------------------------------------- compile handles and the cache


class _Outcome(NamedTuple):
    constraint: CompiledConstraint | None
    error: str | None
    finished_at: float  # time.monotonic() when the compile ended


class CompileHandle:
    """One request's view of a (possibly shared) compile. Poll `ready()`; then `result()`."""

    def __init__(self, key: Constraint, future: Future, timeout_s: float) -> None:
        self.key = key
        self._future = future
        self._deadline = time.monotonic() + timeout_s
        self._timeout_s = timeout_s

    def ready(self) -> bool:
        return self._future.done() or time.monotonic() > self._deadline

    def result(self) -> CompiledConstraint:
        """Raises ConstraintError when the constraint is invalid or its compile overran the limit;
        RuntimeError when called before ready()."""
        if not self._future.done():
            if time.monotonic() <= self._deadline:
                raise RuntimeError("grammar compile not finished: poll ready() first")
            raise self._timeout_error()
        outcome: _Outcome = self._future.result()
        if outcome.finished_at > self._deadline:  # decided by when it finished, not when we polled
            raise self._timeout_error()
        if outcome.error is not None:
            raise ConstraintError(outcome.error)
        return outcome.constraint

    def _timeout_error(self) -> ConstraintError:
        return ConstraintError(f"{self.key[0]}: grammar compile exceeded the time limit "
                               f"(compile_timeout_s={self._timeout_s})")


def _memory_bytes(future: Future) -> int:
    if not future.done():
        return 0
    constraint = future.result().constraint
    return 0 if constraint is None else constraint.grammar.memory_size_bytes


class CompileCache:
    """The compiler, its thread pool and the (kind, text) -> compile cache (of futures, so in-flight compiles
    are shared and hits are countable), bounded in bytes with least-recently-used eviction."""

    def __init__(self, tokenizer_info: xgr.TokenizerInfo, *, num_threads: int, compile_timeout_s: float,
                 strict_json: bool, json_whitespace: str, max_whitespace: int, cache_limit_mb: float) -> None:
        self.compile_timeout_s = compile_timeout_s
        self.strict_json = strict_json
        self.json_whitespace = json_whitespace
        self.max_whitespace = max_whitespace
        self.cache_limit_bytes = int(cache_limit_mb * 2**20)
        self._compiler = xgr.GrammarCompiler(tokenizer_info, max_threads=num_threads, cache_enabled=False)
        self._pool = ThreadPoolExecutor(num_threads, thread_name_prefix="grammar")
        self._cache: OrderedDict[Constraint, Future] = OrderedDict()  # keyed by the request's own record
        self._lock = threading.Lock()
        self._hits = self._misses = 0

    def submit(self, kind: str, text: str) -> CompileHandle:
        """Start (or share) the compile of (kind, text); never raises for a bad constraint: the
        handle's result() does."""
        key = Constraint(kind, text)
        with self._lock:
            fut = self._cache.get(key)
            if fut is not None:
                self._hits += 1
                self._cache.move_to_end(key)
            else:
                self._misses += 1
                fut = self._pool.submit(self._compile, kind, text)
                self._cache[key] = fut
                self._evict()
        return CompileHandle(key, fut, self.compile_timeout_s)

    def poll(self, handle: CompileHandle) -> CompiledConstraint | ConstraintError | None:
        """Non-blocking: None while compiling, the error when the constraint failed, else the grammar."""
        if not handle.ready():
            return None
        try:
            return handle.result()
        except ConstraintError as e:
            return e

    def _evict(self) -> None:
        """Least recently used finished compiles go until the compiled grammars fit the byte limit (a JSON
        schema takes ~0.5 MB for a 49k vocabulary, a long bounded regex several MB)."""
        sizes = {k: _memory_bytes(f) for k, f in self._cache.items()}
        total = sum(sizes.values())
        for key in list(self._cache):
            if total <= self.cache_limit_bytes:
                return
            if self._cache[key].done():
                total -= sizes[key]
                del self._cache[key]

    @property
    def cache_info(self) -> CacheInfo:
        return CacheInfo(self._hits, self._misses, len(self._cache))

    def _compile(self, kind: str, text: str) -> _Outcome:
        try:
            constraint = self._compile_now(kind, text)
            return _Outcome(constraint, None, time.monotonic())
        except ConstraintError as e:
            return _Outcome(None, str(e), time.monotonic())
        except Exception as e:  # noqa: BLE001 - xgrammar raises RuntimeError for every input error
            return _Outcome(None, f"{kind}: {describe(kind)}: {clean_error(e)}", time.monotonic())

    def _compile_now(self, kind: str, text: str) -> CompiledConstraint:
        if kind == "regex":
            return CompiledConstraint(kind, text, self._compiler.compile_regex(text), ())
        if kind == "ebnf":
            return CompiledConstraint(kind, text, self._compiler.compile_grammar(text), ())
        if kind == "choices":
            return CompiledConstraint(kind, text, self._compiler.compile_grammar(choices_to_ebnf(text)), ())
        if kind == "json_schema":
            analysis = analyze_schema(parse_schema(text))
            report_unenforced(kind, analysis.unenforced, self.strict_json)
            if self.json_whitespace == "compact":
                ws = dict(any_whitespace=False, separators=(",", ":"))
            else:
                ws = dict(any_whitespace=True, max_whitespace_cnt=self.max_whitespace)
            ebnf = str(xgr.Grammar.from_json_schema(json.dumps(analysis.schema), strict_mode=True, **ws))
            grammar = self._compiler.compile_grammar(fix_bounded_strings(ebnf))
            return CompiledConstraint(kind, text, grammar, tuple(analysis.unenforced))
        raise ConstraintError(f"constraint kind must be one of {CONSTRAINT_KINDS}, got {kind!r}")

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
