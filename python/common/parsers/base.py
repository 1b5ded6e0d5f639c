"""What every output parser shares: the event records, the streaming contract, small text helpers.

Contract of a parser (one per choice, fed the choice's text deltas in order):
- ``feed(delta)`` returns what is final now; text that may still turn out to be a marker is held back;
- ``finish()`` returns what was held, judged as the end of the output.
Every decision depends on the text alone, never on where the deltas were split, so feeding the whole
text at once and feeding it in any chunks give the same events once merged (tests check this).
"""

from __future__ import annotations

import json
import secrets
import string
from collections.abc import Iterable, Mapping
from typing import Any, NamedTuple


class Content(NamedTuple):
    text: str


class CallStart(NamedTuple):
    index: int  # 0, 1, ... in the order the calls appear
    id: str
    name: str


class CallArgs(NamedTuple):
    index: int
    text: str  # a piece of the call's arguments (a JSON object once all pieces are joined)


Event = Content | CallStart | CallArgs


class ParsedCalls(NamedTuple):
    content: str | None  # the text outside the calls (None when empty)
    calls: list[dict[str, Any]]  # OpenAI tool_calls entries: {"id", "type", "function": {"name", "arguments"}}


class Split(NamedTuple):
    """A reasoning parser's answer: the thinking text and the answer text of one delta."""

    reasoning: str
    content: str


def call_id(style: str = "openai") -> str:
    """A fresh call id; Mistral's templates accept only 9 letters or digits."""
    if style == "mistral":
        return "".join(secrets.choice(string.ascii_letters + string.digits) for _ in range(9))
    return "call_" + secrets.token_hex(12)


def collect(events: Iterable[Event]) -> ParsedCalls:
    """The merged result of a stream of events: the whole content, and each call's name and arguments."""
    content: list[str] = []
    calls: dict[int, dict[str, Any]] = {}
    for e in events:
        if isinstance(e, Content):
            content.append(e.text)
        elif isinstance(e, CallStart):
            calls[e.index] = {"id": e.id, "type": "function", "function": {"name": e.name, "arguments": ""}}
        else:
            calls[e.index]["function"]["arguments"] += e.text
    text = "".join(content)
    if calls:
        text = text.strip()
    return ParsedCalls(text or None, [calls[k] for k in sorted(calls)])


def partial_suffix(text: str, markers: Iterable[str]) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of one of `markers`."""
    best = 0
    for marker in markers:
        for k in range(min(len(marker) - 1, len(text)), best, -1):
            if text.endswith(marker[:k]):
                best = k
                break
    return best


def json_text(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False)


class JsonValueEnd:
    """Finds where one JSON value ends in text that arrives in pieces (strings, escapes, nesting).

    ``scan(text, start)`` returns the end offset (exclusive) once the value is complete, else None (call
    again with more text, the same `start`; the scan resumes where it stopped). A number or literal at
    top level ends at the first character that cannot continue it, so it needs one character of lookahead
    (or ``finish``)."""

    def __init__(self) -> None:
        self.pos = -1
        self.depth = 0
        self.in_string = False
        self.escape = False
        self.scalar = False

    def scan(self, text: str, start: int) -> int | None:
        if self.pos < 0:
            self.pos = start
        i = self.pos
        while i < len(text):
            c = text[i]
            if self.in_string:
                if self.escape:
                    self.escape = False
                elif c == "\\":
                    self.escape = True
                elif c == '"':
                    self.in_string = False
                    if self.depth == 0:
                        return i + 1
            elif self.scalar:
                if c in ",}] \t\r\n;":
                    return i
            elif c == '"':
                self.in_string = True
            elif c in "{[":
                self.depth += 1
            elif c in "}]":
                self.depth -= 1
                if self.depth <= 0:
                    return i + 1
            elif self.depth == 0 and not c.isspace():
                self.scalar = True
            i += 1
            self.pos = i
        return None


def known(name: str, tools: Mapping[str, Any]) -> bool:
    """Calls name a tool of the request (any name when the request lists none, as for unit tests)."""
    return not tools or name in tools


class ToolParser:
    """A tool-call format: splits one choice's output into content and calls, streaming.

    Subclasses implement ``_run(final)``, which consumes ``self.buf`` as far as the text decides and
    reports through ``_content`` / ``_start_call`` / ``_args`` / ``_end_call``. Whitespace next to a call
    is not content (a model writes newlines around its calls)."""

    name = ""
    id_style = "openai"

    def __init__(self, tools: Mapping[str, dict]):
        self.tools = tools  # function name -> its parameters schema
        self.buf = ""
        self.state = "text"
        self.calls = 0
        self._out: list[Event] = []
        self._held_ws = ""  # trailing whitespace of the content: dropped if a call follows
        self._lstrip = False  # right after a call: leading whitespace is dropped

    def feed(self, delta: str) -> list[Event]:
        self.buf += delta
        self._run(final=False)
        return self._take()

    def finish(self) -> list[Event]:
        self._run(final=True)
        if self._held_ws and not self.calls:
            self._out.append(Content(self._held_ws))
        self._held_ws = ""
        return self._take()

    def _take(self) -> list[Event]:
        out, self._out = self._out, []
        return out

    def _run(self, final: bool) -> None:
        raise NotImplementedError

    def _text_until(self, marker: str, then: str, final: bool) -> bool:
        """State "text": content up to `marker`, then state `then` (True: go on parsing); without the marker, the
        content that cannot be the marker's start (all of it when `final`) and False (wait for more text)."""
        i = self.buf.find(marker)
        if i >= 0:
            self._content(self.buf[:i])
            self.buf, self.state = self.buf[i + len(marker):], then
            return True
        keep = 0 if final else partial_suffix(self.buf, [marker])
        self._content(self.buf[:len(self.buf) - keep])
        self.buf = self.buf[len(self.buf) - keep:]
        return False

    def _content(self, text: str) -> None:
        if self._lstrip:
            text = text.lstrip()
            if not text:
                return
            self._lstrip = False
        text = self._held_ws + text
        body = text.rstrip()
        self._held_ws = text[len(body):]
        if body:
            self._out.append(Content(body))

    def _start_call(self, name: str) -> int:
        self._held_ws = ""
        index = self.calls
        self.calls += 1
        self._out.append(CallStart(index, call_id(self.id_style), name))
        return index

    def _args(self, index: int, text: str) -> None:
        if text:
            self._out.append(CallArgs(index, text))

    def _end_call(self) -> None:
        self._lstrip = True

    # ---- how the format is taught and replayed (for templates that do not render tools themselves)

    @classmethod
    def instructions(cls, functions: list[dict]) -> str:
        """A system-message note describing `functions` (OpenAI function dicts) and how to call them."""
        specs = "\n".join(json_text(f) for f in functions)
        example = cls.format_call("<function name>", {"<argument>": "<value>"})
        return (f"You can call the following functions. To call one, reply with {example} and nothing "
                f"else.\n\nFunctions:\n{specs}")

    @classmethod
    def format_call(cls, name: str, arguments: Any) -> str:
        """A call written in this format (assistant turns of the history)."""
        raise NotImplementedError

    @classmethod
    def call_tag(cls, name: str) -> tuple[str, str, str] | None:
        """(trigger, begin, end) around a call's arguments object, for a grammar that enforces the calls
        (server: strict tools); None when the format's calls are not a JSON object between fixed texts."""
        return None
