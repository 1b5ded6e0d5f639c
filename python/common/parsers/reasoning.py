"""Reasoning formats: the thinking a model writes before its answer, between two markers.

- qwen3: a think block only when the output opens with ``<think>`` (or the prompt ends with it: the
  template opened the block, as Qwen3's thinking-only models do);
- deepseek-r1: the output starts inside the block (R1's template writes ``<think>`` into the prompt), so
  everything before ``</think>`` is thinking, unless the prompt already closed the block.
- harmony: gpt-oss's analysis channel (parsers/harmony.py).
Whitespace between the block and the answer belongs to neither.
"""

from __future__ import annotations

from typing import NamedTuple

from radixgen.common.parsers.base import Split, partial_suffix
from radixgen.common.parsers.harmony import HarmonyFormat


class ReasoningFormat(NamedTuple):
    name: str
    start: str
    end: str
    opens_in_prompt: bool  # the template writes the start marker: the output begins inside the block

    def thinking_at_start(self, prompt: str) -> bool:
        """Whether the output of this rendered prompt begins inside the think block."""
        tail = prompt.rstrip()
        if tail.endswith(self.end):
            return False  # the template closed the block itself (thinking switched off)
        return self.opens_in_prompt or tail.endswith(self.start)

    def parser(self, prompt: str = "") -> ReasoningParser:
        return ReasoningParser(self, self.thinking_at_start(prompt))


class ReasoningParser:
    """Splits one choice's output into thinking and answer, streaming (see parsers.base's contract)."""

    def __init__(self, fmt: ReasoningFormat, thinking: bool):
        self.fmt = fmt
        self.state = "think_open" if thinking else "open"  # open: a block may still begin
        self.buf = ""
        self.closed = False  # the block has ended (what comes now is the answer)

    def feed(self, delta: str) -> Split:
        self.buf += delta
        return self._run(final=False)

    def finish(self) -> Split:
        return self._run(final=True)

    def _run(self, final: bool) -> Split:
        start, end = self.fmt.start, self.fmt.end
        reasoning: list[str] = []
        content: list[str] = []
        while True:
            if self.state in ("open", "think_open"):
                s = self.buf.lstrip()
                if not final and (not s or (start.startswith(s) and s != start)):
                    break
                if s.startswith(start):
                    self.buf, self.state = s[len(start):], "think"
                else:
                    self.state = "think" if self.state == "think_open" else "answer"
            if self.state == "think":
                i = self.buf.find(end)
                if i >= 0:
                    reasoning.append(self.buf[:i])
                    self.buf, self.state, self.closed = self.buf[i + len(end):], "lstrip", True
                else:
                    keep = 0 if final else partial_suffix(self.buf, [end])
                    reasoning.append(self.buf[:len(self.buf) - keep])
                    self.buf = self.buf[len(self.buf) - keep:]
                    break
            if self.state == "lstrip":
                self.buf = self.buf.lstrip()
                if not self.buf:
                    break
                self.state = "answer"
            if self.state == "answer":
                content.append(self.buf)
                self.buf = ""
                break
        return Split("".join(reasoning), "".join(content))


REASONING_FORMATS = {
    "qwen3": ReasoningFormat("qwen3", "<think>", "</think>", opens_in_prompt=False),
    "deepseek-r1": ReasoningFormat("deepseek-r1", "<think>", "</think>", opens_in_prompt=True),
    "harmony": HarmonyFormat(),  # gpt-oss: the analysis channel (parsers/harmony.py)
}
