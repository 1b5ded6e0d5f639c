"""Tool-call formats whose calls are JSON objects ``{"name": ..., "arguments": {...}}``:

- hermes (also qwen25): ``<tool_call>{"name": "f", "arguments": {...}}</tool_call>``, any number, after text;
- llama3_json: the whole output is ``{"name": "f", "parameters": {...}}`` (optionally after
  ``<|python_tag|>``), several separated by ``;``;
- mistral: ``[TOOL_CALLS][{"name": "f", "arguments": {...}}, ...]``, or the newer ``[TOOL_CALLS]f[ARGS]{...}``;
- forced (tool_choice "required", under a grammar): a JSON array of call objects, or one object;
- named (tool_choice naming a function, under a grammar): the output is that function's arguments.

The arguments stream as they are generated: once the head of an object (its name, then the key of its
arguments) is read, every character of the arguments value is passed on as it arrives.
"""

from __future__ import annotations

import json
import re
from typing import Any

from radixgen.common.parsers.base import JsonValueEnd, ToolParser, json_text, known, partial_suffix

# the head of a call object whose name comes first; (?=\S): the arguments value has begun
_HEAD = re.compile(r'\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"(?:arguments|parameters)"\s*:\s*(?=\S)')


class JsonCall:
    """One call object of `parser.buf` from offset `start` (its "{"), read as it grows."""

    def __init__(self, parser: ToolParser, start: int):
        self.p = parser
        self.start = start
        self.end = JsonValueEnd()
        self.index: int | None = None  # set once the call is announced
        self.rejected = False  # the head names an unknown tool: the object is content
        self.args_at = -1  # offset of the arguments value when streaming it
        self.args_end = JsonValueEnd()
        self.sent = -1  # offset up to which the arguments were passed on

    def advance(self, final: bool) -> tuple[int, bool] | None:
        """(end offset, is a call) once the object is over (or the text ends), else None."""
        buf = self.p.buf
        if self.index is None and not self.rejected:
            m = _HEAD.match(buf, self.start)
            if m:
                name = json.loads(f'"{m.group(1)}"')
                if known(name, self.p.tools):
                    self.index = self.p._start_call(name)
                    if buf[m.end()] != '"':  # an arguments string (JSON inside a string) is decoded at the end
                        self.args_at = self.sent = m.end()
                else:
                    self.rejected = True
        if self.args_at >= 0:
            stop = self.args_end.scan(buf, self.args_at)
            upto = len(buf) if stop is None else stop
            if upto > self.sent:
                self.p._args(self.index, buf[self.sent:upto])  # type: ignore[arg-type]
                self.sent = upto
        end = self.end.scan(buf, self.start)
        if end is None and not final:
            return None
        if end is None:  # cut off: what was announced stays a (truncated) call
            return len(buf), self.index is not None
        if self.index is not None:
            if self.args_at < 0:
                self._args_at_end(buf[self.start:end])
            return end, True
        if self.rejected:
            return end, False
        return end, self._whole(buf[self.start:end])

    def _args_at_end(self, text: str) -> None:
        try:
            args = json.loads(text).get("arguments", json.loads(text).get("parameters"))
        except (ValueError, AttributeError):
            return
        self.p._args(self.index, args if isinstance(args, str) else json_text(args))  # type: ignore[arg-type]

    def _whole(self, text: str) -> bool:
        """An object whose head did not match (keys in another order): a call if it parses as one."""
        try:
            obj = json.loads(text)
        except ValueError:
            return False
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not known(obj["name"], self.p.tools):
            return False
        args = obj.get("arguments", obj.get("parameters", {}))
        self.index = self.p._start_call(obj["name"])
        self.p._args(self.index, args if isinstance(args, str) else json_text(args))
        return True


class HermesParser(ToolParser):
    name = "hermes"
    OPEN, CLOSE = "<tool_call>", "</tool_call>"

    def __init__(self, tools):
        super().__init__(tools)
        self.call: JsonCall | None = None

    def _run(self, final: bool) -> None:
        while True:
            if self.state == "text":
                if self._text_until(self.OPEN, "open", final):
                    continue
                return
            if self.state == "open":
                s = self.buf.lstrip()
                if not s and not final:
                    return
                if not s.startswith("{"):
                    self._content(self.OPEN)  # not a JSON call: the marker is text
                    self.state = "text"
                    continue
                self.buf, self.state, self.call = s, "call", JsonCall(self, 0)
            if self.state == "call":
                done = self.call.advance(final)  # type: ignore[union-attr]
                if done is None:
                    return
                end, ok = done
                if ok:
                    self._end_call()
                else:
                    self._content(self.OPEN + self.buf[:end])
                self.buf, self.state = self.buf[end:], "close" if ok else "text"
            if self.state == "close":
                s = self.buf.lstrip()
                if not final and (not s or (self.CLOSE.startswith(s) and s != self.CLOSE)):
                    return
                if s.startswith(self.CLOSE):
                    self.buf = s[len(self.CLOSE):]
                elif final and self.CLOSE.startswith(s):
                    self.buf = ""  # cut off inside the closing marker
                self.state = "text"
                if final and not self.buf:
                    return

    @classmethod
    def format_call(cls, name: str, arguments: Any) -> str:
        return cls.OPEN + json_text({"name": name, "arguments": arguments}) + cls.CLOSE

    @classmethod
    def call_tag(cls, name: str) -> tuple[str, str, str]:
        return cls.OPEN, f'{cls.OPEN}\n{{"name": {json_text(name)}, "arguments": ', "}\n" + cls.CLOSE


class Llama3JsonParser(ToolParser):
    """Calls only when the output begins with one (Llama 3.1's JSON tool calling)."""

    name = "llama3_json"
    TAG = "<|python_tag|>"

    def __init__(self, tools):
        super().__init__(tools)
        self.state = "start"
        self.call: JsonCall | None = None

    def _run(self, final: bool) -> None:
        while True:
            if self.state in ("start", "next"):
                s = self.buf.lstrip()
                if not final and (not s or (self.TAG.startswith(s) and s != self.TAG)):
                    return
                if self.state == "start" and s.startswith(self.TAG):
                    s = s[len(self.TAG):].lstrip()
                    if not s and not final:
                        return
                if s.startswith("{"):
                    self.buf, self.state, self.call = s, "call", JsonCall(self, 0)
                else:
                    self.state = "text"
            if self.state == "call":
                done = self.call.advance(final)  # type: ignore[union-attr]
                if done is None:
                    return
                end, ok = done
                if ok:
                    self._end_call()
                    self.buf, self.state = self.buf[end:], "sep"
                else:
                    self.state = "text"
            if self.state == "sep":
                s = self.buf.lstrip()
                if not s and not final:
                    return
                if s.startswith(";"):
                    self.buf, self.state = s[1:], "next"
                    continue
                self.state = "text"
            if self.state == "text":
                self._content(self.buf)
                self.buf = ""
                return

    @classmethod
    def format_call(cls, name: str, arguments: Any) -> str:
        return json_text({"name": name, "parameters": arguments})

    @classmethod
    def call_tag(cls, name: str) -> tuple[str, str, str]:
        return '{"name": ', f'{{"name": {json_text(name)}, "parameters": ', "}"


class MistralParser(ToolParser):
    name = "mistral"
    id_style = "mistral"
    MARKER, ARGS = "[TOOL_CALLS]", "[ARGS]"
    _NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")

    def __init__(self, tools):
        super().__init__(tools)
        self.call: JsonCall | None = None
        self.args_end: JsonValueEnd | None = None
        self.args_index = -1
        self.sent = 0

    def _run(self, final: bool) -> None:
        while True:
            if self.state == "text":
                if self._text_until(self.MARKER, "after", final):
                    continue
                return
            if self.state in ("after", "array"):
                s = self.buf.lstrip()
                if self.state == "array":
                    s = s.lstrip(", \n\t")
                if not s:
                    return
                if self.state == "after" and s.startswith("["):
                    self.buf, self.state = s[1:], "array"
                    continue
                if s.startswith("{"):
                    self.buf, self.call = s, JsonCall(self, 0)
                    self.state = "call_in_array" if self.state == "array" else "call_alone"
                elif self.state == "array" and s.startswith("]"):
                    self.buf, self.state = s[1:], "text"
                    continue
                elif self.state == "after" and not self._named(s, final):
                    return
                elif self.state == "array":
                    self.state = "text"  # not a call: the rest is text
                    continue
            if self.state in ("call_in_array", "call_alone"):
                done = self.call.advance(final)  # type: ignore[union-attr]
                if done is None:
                    return
                end, ok = done
                if not ok:
                    self.state = "text"
                    continue
                self._end_call()
                self.buf = self.buf[end:]
                self.state = "array" if self.state == "call_in_array" else "text"
            if self.state == "args":
                stop = self.args_end.scan(self.buf, 0)  # type: ignore[union-attr]
                upto = len(self.buf) if stop is None else stop
                self._args(self.args_index, self.buf[self.sent:upto])
                self.sent = upto
                if stop is None and not final:
                    return
                self.buf, self.state = self.buf[upto:], "text"
                self._end_call()

    def _named(self, s: str, final: bool) -> bool:
        """The ``name[ARGS]{...}`` form; False while the name may still be arriving."""
        i = s.find(self.ARGS)
        if i < 0:
            head = s[:len(s) - partial_suffix(s, [self.ARGS])].strip()
            if not final and len(s) < 80 and (not head or self._NAME.fullmatch(head)):
                return False
        name = s[:i].strip() if i >= 0 else ""
        if i < 0 or not self._NAME.fullmatch(name) or not known(name, self.tools):
            self._content(self.MARKER)  # not a call: the marker is text, the rest is read as text
            self.buf, self.state = s, "text"
            return True
        self.args_index = self._start_call(name)
        self.buf = s[i + len(self.ARGS):].lstrip()
        self.args_end, self.sent, self.state = JsonValueEnd(), 0, "args"
        return True

    @classmethod
    def format_call(cls, name: str, arguments: Any) -> str:
        return cls.MARKER + json_text([{"name": name, "arguments": arguments}])

    @classmethod
    def call_tag(cls, name: str) -> tuple[str, str, str]:
        return cls.MARKER, f'{cls.MARKER}[{{"name": {json_text(name)}, "arguments": ', "}]"


class ForcedParser(MistralParser):
    """tool_choice "required": what the grammar lets out, a JSON array of call objects (or one object)."""

    name = "forced"
    id_style = "openai"

    def __init__(self, tools):
        super().__init__(tools)
        self.state = "after"

    def _named(self, s: str, final: bool) -> bool:
        self.buf, self.state = s, "text"  # not calls (only when cut off): the text is content
        return True


class NamedParser(ToolParser):
    """tool_choice naming a function: the output is its arguments object (enforced by the grammar)."""

    name = "named"

    def __init__(self, tools, function: str):
        super().__init__(tools)
        self.function = function
        self.index = -1

    def _run(self, final: bool) -> None:
        if self.index < 0:
            s = self.buf.lstrip()
            if not s and not final:
                return
            self.index, self.buf = self._start_call(self.function), s
        self._args(self.index, self.buf)
        self.buf = ""
