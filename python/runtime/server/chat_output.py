"""A chat choice's output as message fields, streamed or whole: the thinking (``reasoning_content``, and
vLLM's ``reasoning``), the answer (``content``) and the calls (``tool_calls``, or the legacy
``function_call``). The text goes through the reasoning parser first, then its answer part through the
tool-call parser; a whole response is the same parsers fed the whole text, so it equals the stream."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

from radixgen.common.parsers import CallStart, Content, Event, ReasoningParser, ToolParser, collect


class ChatOutput(NamedTuple):
    """What a request's choices are parsed with (one ChoiceOutput per choice)."""

    reasoning: Callable[[], ReasoningParser] | None  # None: no think block is separated
    tools: Callable[[], ToolParser] | None  # None: calls are not read (no tools, or tool_choice none)
    legacy: bool  # answer in the legacy `function_call` shape (one call)
    stream_reasoning: bool  # else the thinking is sent in one delta once the block ends

    def choice(self) -> ChoiceOutput:
        return ChoiceOutput(self)


class ChoiceOutput:
    def __init__(self, spec: ChatOutput):
        self.spec = spec
        self.reasoning = spec.reasoning() if spec.reasoning else None
        self.tools = spec.tools() if spec.tools else None
        self.calls = 0
        self.held_reasoning = ""  # with stream_reasoning false: the thinking not yet sent
        self._events: list[Event] = []  # every tool-parser event so far (the whole message is built from them)

    def feed(self, delta: str) -> list[dict[str, Any]]:
        """The chunk deltas (dicts) that `delta` makes final."""
        if self.reasoning is None:
            return self._answer(delta, final=False)
        split = self.reasoning.feed(delta)
        return self._thinking(split.reasoning, final=self.reasoning.closed) + self._answer(split.content, False)

    def finish(self) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        if self.reasoning is not None:
            split = self.reasoning.finish()
            out += self._thinking(split.reasoning, final=True) + self._answer(split.content, False)
        return out + self._answer("", final=True)

    def finish_reason(self, engine_reason: str) -> str:
        """The engine's reason ("length" stays "length" even inside a call); a choice that stopped after
        making calls: "tool_calls" (or "function_call")."""
        if engine_reason == "stop" and self.calls:
            return "function_call" if self.spec.legacy else "tool_calls"
        return engine_reason

    def message(self, text: str) -> dict[str, Any]:
        """The whole message of a non-streamed choice."""
        deltas = self.feed(text) + self.finish()
        reasoning = "".join(d.get("reasoning_content", "") for d in deltas)
        if self.tools is None:
            msg: dict[str, Any] = {"content": "".join(d.get("content", "") for d in deltas)}
        else:
            parsed = collect(self._events)
            msg = {"content": parsed.content}
            if parsed.calls:
                msg.update({"function_call": parsed.calls[0]["function"]} if self.spec.legacy
                           else {"tool_calls": parsed.calls})
        if self.spec.reasoning is not None:
            msg.update(reasoning_content=reasoning or None, reasoning=reasoning or None)
        return msg

    # ------------------------------------------------------------ the parts

    def _thinking(self, text: str, final: bool) -> list[dict[str, Any]]:
        if not self.spec.stream_reasoning:
            self.held_reasoning += text
            if not final:
                return []
            text, self.held_reasoning = self.held_reasoning, ""
        return [{"reasoning_content": text, "reasoning": text}] if text else []

    def _answer(self, text: str, final: bool) -> list[dict[str, Any]]:
        if self.tools is None:
            return [{"content": text}] if text else []
        events = self.tools.finish() if final else self.tools.feed(text)
        self._events += events
        return [d for e in events if (d := self._delta(e)) is not None]

    def _delta(self, e: Event) -> dict[str, Any] | None:
        if isinstance(e, Content):
            return {"content": e.text}
        if isinstance(e, CallStart):
            self.calls += 1
        if self.spec.legacy:  # one call in the legacy shape: the first
            if e.index != 0:
                return None
            fn = {"name": e.name, "arguments": ""} if isinstance(e, CallStart) else {"arguments": e.text}
            return {"function_call": fn}
        if isinstance(e, CallStart):
            call = {"index": e.index, "id": e.id, "type": "function", "function": {"name": e.name, "arguments": ""}}
        else:
            call = {"index": e.index, "function": {"arguments": e.text}}
        return {"tool_calls": [call]}
