"""The qwen3_coder tool-call format (Qwen3-Coder's template): XML-like calls whose parameter values are
raw text, converted to JSON by the type the tool's schema gives the parameter::

    <tool_call>
    <function=get_weather>
    <parameter=city>
    Paris
    </parameter>
    </function>
    </tool_call>

The arguments stream one parameter at a time: ``{"city": "Paris"`` when the first closes, ``, "days": 3``
after the next, ``}`` at ``</function>``."""

from __future__ import annotations

import json
from typing import Any

from radixgen.common.parsers.base import ToolParser, json_text, known

OPEN, CLOSE = "<tool_call>", "</tool_call>"
FN, FN_CLOSE = "<function=", "</function>"
PARAM, PARAM_CLOSE = "<parameter=", "</parameter>"


def convert(raw: str, schema: dict) -> Any:
    """A parameter's text as the JSON value its schema's type asks for (the text itself when it does not
    read as one)."""
    text = raw[1:] if raw.startswith("\n") else raw
    text = text[:-1] if text.endswith("\n") else text
    kind = schema.get("type") if isinstance(schema, dict) else None
    kinds = kind if isinstance(kind, list) else [kind]
    if "string" in kinds and len(kinds) == 1:
        return text
    value = text.strip()
    if value.lower() in ("null", "none") and ("null" in kinds or kind is None):
        return None
    if "boolean" in kinds and value.lower() in ("true", "false"):
        return value.lower() == "true"
    if "integer" in kinds:
        try:
            return int(value)
        except ValueError:
            pass
    try:
        return json.loads(value)
    except ValueError:
        return text


class Qwen3CoderParser(ToolParser):
    name = "qwen3_coder"

    def __init__(self, tools):
        super().__init__(tools)
        self.index = -1
        self.function = ""
        self.params = 0

    def _run(self, final: bool) -> None:
        while True:
            s = self.buf.lstrip()
            if self.state == "text":
                if self._text_until(OPEN, "open", final):
                    continue
                return
            if self.state == "open":
                j = s.find(">")
                if j < 0 and not final and (FN.startswith(s) or (s.startswith(FN) and len(s) < 100)):
                    return
                name = s[len(FN):j].strip() if s.startswith(FN) and j >= 0 else ""
                if not name or not known(name, self.tools):
                    self._content(OPEN)  # not a call: the marker is text
                    self.state = "text"
                    continue
                self.index, self.function, self.params = self._start_call(name), name, 0
                self.buf, self.state = s[j + 1:], "body"
                continue
            if self.state == "body":
                if s.startswith(PARAM):
                    j, k = s.find(">"), s.find(PARAM_CLOSE)
                    if j < 0 or k < 0:
                        if not final:
                            return
                        self.buf = ""  # cut off inside a parameter: it is dropped
                        self._close()
                        continue
                    pname = s[len(PARAM):j].strip()
                    props = (self.tools.get(self.function) or {}).get("properties") or {}
                    value = convert(s[j + 1:k], props.get(pname, {}))
                    head = "{" if self.params == 0 else ", "
                    self._args(self.index, f"{head}{json_text(pname)}: {json_text(value)}")
                    self.params += 1
                    self.buf = s[k + len(PARAM_CLOSE):]
                    continue
                if s.startswith(FN_CLOSE):
                    self._args(self.index, "}" if self.params else "{}")
                    self._end_call()
                    self.buf, self.state = s[len(FN_CLOSE):], "close"
                    continue
                if not final and (PARAM.startswith(s) or FN_CLOSE.startswith(s)):
                    return
                self.buf = s  # the call breaks off: what follows is text
                self._close()
                continue
            if self.state == "close":
                if not final and (not s or (CLOSE.startswith(s) and s != CLOSE)):
                    return
                if s.startswith(CLOSE):
                    self.buf = s[len(CLOSE):]
                elif final and CLOSE.startswith(s):
                    self.buf = ""  # cut off inside the closing marker
                self.state = "text"
                if final and not self.buf:
                    return

    def _close(self) -> None:
        """The call ends without its </function>: close its arguments."""
        self._args(self.index, "}" if self.params else "{}")
        self._end_call()
        self.state = "text"

    @classmethod
    def format_call(cls, name: str, arguments: Any) -> str:
        args = arguments if isinstance(arguments, dict) else {}
        params = "".join(
            f"{PARAM}{k}>\n{v if isinstance(v, str) else json_text(v)}\n{PARAM_CLOSE}\n" for k, v in args.items()
        )
        return f"{OPEN}\n{FN}{name}>\n{params}{FN_CLOSE}\n{CLOSE}"
