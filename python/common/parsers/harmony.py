"""The harmony format (gpt-oss): the output is a sequence of messages, each a header and a body,

    [<|start|>ROLE] [ to=RECIPIENT]<|channel|>CHANNEL[ to=RECIPIENT][ <|constrain|>TYPE]<|message|>BODY END

with END one of <|end|> (more messages follow), <|call|> (a tool call: the body is its arguments) and
<|return|> (the last message). The first message has no <|start|>: the prompt ends with ``<|start|>assistant``.
Channels: ``analysis`` (the chain of thought: ``reasoning_content``), ``commentary`` (tool calls, which carry a
recipient ``functions.NAME``, and preambles) and ``final`` (the answer: ``content``).

`HarmonyReader` splits the text into message events incrementally; `HarmonyReasoningParser` (the reasoning
parser's contract) sends analysis bodies to the thinking and the rest to the answer, a call kept in its harmony
form; `HarmonyToolParser` (the tool parser's contract) reads the calls from that. The special tokens must be in
the text: a request in this format is detokenized with skip_special_tokens false.
"""

from __future__ import annotations

import re
from typing import NamedTuple

from radixgen.common.parsers.base import Split, ToolParser, json_text, known, partial_suffix

START, CHANNEL, MESSAGE, CONSTRAIN = "<|start|>", "<|channel|>", "<|message|>", "<|constrain|>"
ENDS = ("<|end|>", "<|call|>", "<|return|>")
MAX_HEADER = 1024  # a header longer than this without <|message|> is not a header: it is plain text
_RECIPIENT = re.compile(r"to=([^\s<]+)")
_CHANNEL = re.compile(re.escape(CHANNEL) + r"\s*([^\s<]+)")
_CONSTRAINT = re.compile(re.escape(CONSTRAIN) + r"\s*([^\s<]+)")


class Header(NamedTuple):
    role: str
    channel: str | None
    recipient: str | None
    content_type: str | None

    @property
    def is_call(self) -> bool:
        return self.role == "assistant" and self.recipient is not None and self.recipient != "assistant"

    def text(self) -> str:
        """The header as the model writes it (a call passed on to the tool parser)."""
        ctype = f" {CONSTRAIN}{self.content_type}" if self.content_type else ""
        return f"{CHANNEL}{self.channel or 'commentary'} to={self.recipient}{ctype}{MESSAGE}"


def parse_header(raw: str, role: str) -> Header:
    """The header text between <|start|> (or the output's start) and <|message|>; `role` when it names none."""
    head = raw.split(CHANNEL, 1)[0].strip()
    first = head.split()[0] if head and not head.startswith("to=") else ""
    channel = _CHANNEL.search(raw)
    recipient = _RECIPIENT.search(raw)
    constraint = _CONSTRAINT.search(raw)
    ctype = constraint.group(1) if constraint else None
    if ctype is None and channel:  # "<|channel|>commentary json": a content type without <|constrain|>
        rest = [w for w in raw[channel.end():].split() if not w.startswith("to=")]
        ctype = rest[0] if rest else None
    return Header(first or role, channel.group(1) if channel else None, recipient.group(1) if recipient else None,
                  ctype)


class HarmonyReader:
    """Message events of harmony text fed in pieces: ("text", s) outside any message, ("open", Header),
    ("body", s), ("close", end marker or None at the end of the output). Text that may be the start of a marker
    is held until the next piece decides it."""

    def __init__(self) -> None:
        self.buf = ""
        self.state = "between"
        self.role = "assistant"  # the role of the header being read
        self.at_start = True  # the first message: the prompt wrote its <|start|>assistant

    def feed(self, text: str, final: bool = False) -> list[tuple]:
        self.buf += text
        out: list[tuple] = []
        while self.buf or final:
            if self.state == "between" and not self._between(out, final):
                break
            if self.state == "header" and not self._header(out, final):
                break
            if self.state == "body" and not self._body(out, final):
                break
        if final and self.state == "body":
            out.append(("close", None))
            self.state = "between"
        return out

    def _between(self, out: list, final: bool) -> bool:
        b = self.buf
        opens = [START, CHANNEL] + (["to=", " to="] if self.at_start else [])
        for m in opens:
            if b.startswith(m):
                if m == START:
                    self.buf, self.role = b[len(m):], ""
                else:
                    self.role = "assistant"
                self.state = "header"
                return True
        if not final and any(m.startswith(b) for m in opens):
            return False  # may still become a marker
        cut = [i for i in (b.find(START), b.find(CHANNEL)) if i > 0]
        if cut:  # text, then a marker
            out.append(("text", b[:min(cut)]))
            self.buf, self.at_start = b[min(cut):], False
            return True
        keep = 0 if final else partial_suffix(b, [START, CHANNEL])
        if len(b) > keep:
            out.append(("text", b[:len(b) - keep]))
            self.at_start = False
        self.buf = b[len(b) - keep:]
        return False

    def _header(self, out: list, final: bool) -> bool:
        i = self.buf.find(MESSAGE)
        if i < 0:
            if not final and len(self.buf) <= MAX_HEADER:
                return False
            out.append(("text", ("" if self.role else START) + self.buf))  # not a header after all
            self.buf, self.state, self.at_start = "", "between", False
            return False
        out.append(("open", parse_header(self.buf[:i], self.role or "assistant")))
        self.buf, self.state, self.at_start = self.buf[i + len(MESSAGE):], "body", False
        return True

    def _body(self, out: list, final: bool) -> bool:
        found = [(i, m) for m in (*ENDS, START) if (i := self.buf.find(m)) >= 0]
        if found:
            i, m = min(found)
            if i:
                out.append(("body", self.buf[:i]))
            # a <|start|> without an end marker ends the message too (it is not consumed)
            self.buf = self.buf[i + len(m):] if m != START else self.buf[i:]
            out.append(("close", m if m != START else None))
            self.state = "between"
            return True
        keep = 0 if final else partial_suffix(self.buf, [*ENDS, START])
        if len(self.buf) > keep:
            out.append(("body", self.buf[:len(self.buf) - keep]))
        self.buf = self.buf[len(self.buf) - keep:]
        return False


class HarmonyFormat:
    """The harmony reasoning format (the interface of parsers.reasoning.ReasoningFormat): the analysis channel is
    the thinking. `start` / `end` are the analysis message's own markers."""

    name = "harmony"
    start = f"{CHANNEL}analysis{MESSAGE}"
    end = "<|end|>"
    opens_in_prompt = False

    def thinking_at_start(self, prompt: str) -> bool:
        return prompt.rstrip().endswith(self.start)

    def parser(self, prompt: str = "") -> HarmonyReasoningParser:
        return HarmonyReasoningParser(self.thinking_at_start(prompt))


class HarmonyReasoningParser:
    """Analysis bodies -> reasoning; final and commentary bodies -> the answer; a call -> the answer in its harmony
    form (header, arguments, <|call|>) for the tool parser; text outside any message -> the answer."""

    def __init__(self, thinking: bool = False) -> None:
        self.reader = HarmonyReader()
        if thinking:  # the prompt opened the analysis message
            self.reader.state, self.reader.at_start = "body", False
        self.kind = "analysis" if thinking else "answer"  # where the open message's body goes
        self.closed = False  # a message other than analysis has begun (the thinking so far is whole)

    def feed(self, delta: str) -> Split:
        return self._split(self.reader.feed(delta))

    def finish(self) -> Split:
        split = self._split(self.reader.feed("", final=True))
        self.closed = True
        return split

    def _split(self, events: list[tuple]) -> Split:
        reasoning: list[str] = []
        content: list[str] = []
        for kind, value in events:
            if kind == "open":
                if value.is_call:
                    self.kind = "call"
                    content.append(value.text())
                else:
                    self.kind = "analysis" if value.channel == "analysis" else "answer"
                self.closed = self.closed or self.kind != "analysis"
            elif kind == "body":
                (reasoning if self.kind == "analysis" else content).append(value)
            elif kind == "close":
                if self.kind == "call":
                    content.append("<|call|>")
                self.kind = "answer"
            else:
                content.append(value)
        return Split("".join(reasoning), "".join(content))


class HarmonyToolParser(ToolParser):
    """Calls to ``functions.NAME`` (the commentary channel) -> tool calls, their bodies the arguments; every other
    message's body and text outside messages -> content."""

    name = "harmony"

    def __init__(self, tools):
        super().__init__(tools)
        self.reader = HarmonyReader()
        self.call: int | None = None  # the index of the open call
        self.has_args = False  # the open call's body has begun

    def _run(self, final: bool) -> None:
        text, self.buf = self.buf, ""
        for kind, value in self.reader.feed(text, final):
            if kind == "open":
                name = (value.recipient or "").removeprefix("functions.")
                if value.is_call and value.recipient.startswith("functions.") and known(name, self.tools):
                    self.call, self.has_args = self._start_call(name), False
            elif kind == "body":
                if self.call is None:
                    self._content(value)
                else:
                    self._args(self.call, value)
                    self.has_args = self.has_args or bool(value)
            elif kind == "close":
                if self.call is not None:
                    if not self.has_args and value == "<|call|>":  # a call without arguments: an empty object
                        self._args(self.call, "{}")
                    self._end_call()
                self.call = None
            else:
                self._content(value)

    @classmethod
    def format_call(cls, name: str, arguments) -> str:
        args = arguments if isinstance(arguments, str) else json_text(arguments)
        return f"{START}assistant{CHANNEL}commentary to=functions.{name} {CONSTRAIN}json{MESSAGE}{args}<|call|>"

    @classmethod
    def instructions(cls, functions: list[dict]) -> str:
        from radixgen.common.harmony_prompt import tools_namespace

        return tools_namespace(functions)
