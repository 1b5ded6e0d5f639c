"""The pythonic tool-call format (Llama 3.2 / Llama 4 templates): the output is a Python list of calls,
``[get_weather(city="Paris"), get_time()]``, optionally inside ``<|python_start|>`` ... ``<|python_end|>``.

Each call is announced, with its arguments as one JSON object, as soon as its closing parenthesis is
generated (its keyword values are Python literals: they are converted once whole)."""

from __future__ import annotations

import ast
import re
from typing import Any

from radixgen.common.parsers.base import ToolParser, json_text, known

_START, _END = "<|python_start|>", "<|python_end|>"
_OPENS = re.compile(r"\[\s*[A-Za-z_]\w*\s*\(")  # a list whose first item is a call
_MAY_OPEN = re.compile(r"\[\s*(?:[A-Za-z_]\w*\s*)?")  # what may still become one


def _call_end(text: str) -> int | None:
    """Offset just past the ")" closing the call at the start of `text`, or None if it is not there yet."""
    depth, quote, escape = 0, "", False
    for i, c in enumerate(text):
        if quote:
            if escape:
                escape = False
            elif c == "\\":
                escape = True
            elif c == quote:
                quote = ""
        elif c in "\"'":
            quote = c
        elif c in "([{":
            depth += 1
        elif c in ")]}":
            depth -= 1
            if depth == 0:
                return i + 1 if c == ")" else None
            if depth < 0:
                return None
    return None


def _parse_call(src: str) -> tuple[str, dict[str, Any]] | None:
    try:
        node = ast.parse(src.strip(), mode="eval").body
    except SyntaxError:
        return None
    if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name) or node.args:
        return None
    try:
        args = {k.arg: ast.literal_eval(k.value) for k in node.keywords if k.arg is not None}
    except ValueError:
        return None
    if len(args) != len(node.keywords):
        return None
    return node.func.id, args


class PythonicParser(ToolParser):
    name = "pythonic"

    def __init__(self, tools):
        super().__init__(tools)
        self.state = "start"

    def _run(self, final: bool) -> None:
        while True:
            if self.state == "start":
                s = self.buf.lstrip()
                if not final and (not s or (_START.startswith(s) and s != _START)):
                    return
                if s.startswith(_START):
                    s = s[len(_START):].lstrip()
                    if not s and not final:
                        return
                if not _OPENS.match(s):
                    if not final and _MAY_OPEN.fullmatch(s):
                        return
                    self.state = "text"
                    continue
                self.buf, self.state = s[1:], "calls"
            if self.state == "calls":
                s = self.buf.lstrip().lstrip(",").lstrip()
                if not s:
                    self.buf = ""
                    return
                if s.startswith("]"):
                    self.buf, self.state = s[1:], "end"
                    continue
                end = _call_end(s)
                if end is None:
                    if final or not s[0].isidentifier():
                        self.buf, self.state = s, "text"
                        continue
                    self.buf = s
                    return
                parsed = _parse_call(s[:end])
                if parsed is None or not known(parsed[0], self.tools):
                    self.buf, self.state = s, "text"
                    continue
                index = self._start_call(parsed[0])
                self._args(index, json_text(parsed[1]))
                self._end_call()
                self.buf = s[end:]
            if self.state == "end":  # after the list: its closing tag, if any
                s = self.buf.lstrip()
                if not final and _END.startswith(s) and s != _END:
                    return
                self.buf, self.state = s[len(_END):] if s.startswith(_END) else self.buf, "text"
            if self.state == "text":
                self._content(self.buf)
                self.buf = ""
                return

    @classmethod
    def format_call(cls, name: str, arguments: Any) -> str:
        args = arguments if isinstance(arguments, dict) else {}
        return "[" + name + "(" + ", ".join(f"{k}={v!r}" for k, v in args.items()) + ")]"
