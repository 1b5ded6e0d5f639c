"""Errors that remember the program line that appended the failing expression."""

from __future__ import annotations

import os
import sys
from typing import NamedTuple

# Frames under this folder (the language itself) are skipped when looking for the program line.
LANG_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class Origin(NamedTuple):
    filename: str
    lineno: int
    function: str
    code: str

    def __str__(self) -> str:
        return f"{self.filename}:{self.lineno} in {self.function}: {self.code}"


def _in_lang(filename: str) -> bool:
    path = os.path.abspath(filename)
    return path.startswith(LANG_DIR + os.sep)


def caller_origin() -> Origin | None:
    """The first frame outside radixgen.lang: the program line that appended the expression."""
    import linecache

    frame = sys._getframe(1)
    while frame is not None and _in_lang(frame.f_code.co_filename):
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


class TraceStop(Exception):
    """Raised into a traced program at its first model call (or its first read of a value)."""
