"""A response's output items and stream events, built from the chat deltas of its one choice
(chat_output.ChoiceOutput: thinking, answer text, tool-call starts and argument pieces).

Items, in the order the model writes them: ``reasoning`` (its text as one ``reasoning_text`` content part),
``message`` (one ``output_text`` part), ``function_call`` (one per call). Each item is announced
(``response.output_item.added``), grows by deltas (``response.reasoning_text.delta``,
``response.output_text.delta``, ``response.function_call_arguments.delta``) and is closed by its ``.done``
events and ``response.output_item.done`` once the next item begins or the output ends. A whole
(non-streamed) response is the same builder fed the whole text, so it equals the stream's last state."""

from __future__ import annotations

import secrets
from typing import Any


def item_id(prefix: str) -> str:
    return f"{prefix}_{secrets.token_hex(12)}"


class ResponseOutput:
    def __init__(self) -> None:
        self.items: list[dict[str, Any]] = []  # every item so far (the last one may be open)
        self.open: str | None = None  # the kind of the open item: "reasoning", "message", "function_call"
        self.calls: dict[int, int] = {}  # tool-call index -> output index

    # ------------------------------------------------------------ chat deltas in, events out

    def feed(self, deltas: list[dict[str, Any]]) -> list[dict[str, Any]]:
        events: list[dict[str, Any]] = []
        for d in deltas:
            if d.get("reasoning_content"):
                events += self._text("reasoning", d["reasoning_content"])
            if d.get("content"):
                events += self._text("message", d["content"])
            for call in d.get("tool_calls") or []:
                events += self._call(call)
        return events

    def close(self, status: str = "completed") -> list[dict[str, Any]]:
        """The events that close the open item (`status`: "completed", or "incomplete" when cut off)."""
        if self.open is None:
            return []
        k, item = len(self.items) - 1, self.items[-1]
        kind, self.open = self.open, None
        item["status"] = status
        head = {"item_id": item["id"], "output_index": k}
        if kind == "function_call":
            return [{"type": "response.function_call_arguments.done", **head, "arguments": item["arguments"],
                     "name": item["name"]}, self._item_event("done", k)]
        part = item["content"][0]
        done = "response.reasoning_text.done" if kind == "reasoning" else "response.output_text.done"
        text_done = {"type": done, **head, "content_index": 0, "text": part["text"]}
        if kind == "message":
            text_done["logprobs"] = []
        return [text_done, {"type": "response.content_part.done", **head, "content_index": 0, "part": dict(part)},
                self._item_event("done", k)]

    # ------------------------------------------------------------ the parts

    def _item_event(self, what: str, k: int) -> dict[str, Any]:
        item = self.items[k]
        snapshot = {**item, "content": [dict(p) for p in item["content"]]} if "content" in item else dict(item)
        return {"type": f"response.output_item.{what}", "output_index": k, "item": snapshot}

    def _begin(self, kind: str, item: dict[str, Any]) -> list[dict[str, Any]]:
        events = self.close()
        self.items.append(item)
        self.open = kind
        k = len(self.items) - 1
        added = self._item_event("added", k)
        events.append(added)
        if kind != "function_call":  # announced empty, then its one content part
            added["item"]["content"] = []
            events.append({"type": "response.content_part.added", "item_id": item["id"], "output_index": k,
                           "content_index": 0, "part": {**item["content"][0], "text": ""}})
        return events

    def _text(self, kind: str, text: str) -> list[dict[str, Any]]:
        events: list[dict[str, Any]] = []
        if self.open != kind:
            if kind == "reasoning":
                item = {"id": item_id("rs"), "type": "reasoning", "summary": [],
                        "content": [{"type": "reasoning_text", "text": ""}], "status": "in_progress"}
            else:
                item = {"id": item_id("msg"), "type": "message", "role": "assistant", "status": "in_progress",
                        "content": [{"type": "output_text", "text": "", "annotations": [], "logprobs": []}]}
            events = self._begin(kind, item)
        k, item = len(self.items) - 1, self.items[-1]
        item["content"][0]["text"] += text
        name = "response.reasoning_text.delta" if kind == "reasoning" else "response.output_text.delta"
        delta = {"type": name, "item_id": item["id"], "output_index": k, "content_index": 0, "delta": text}
        if kind == "message":
            delta["logprobs"] = []
        return [*events, delta]

    def _call(self, call: dict[str, Any]) -> list[dict[str, Any]]:
        events: list[dict[str, Any]] = []
        fn = call.get("function") or {}
        if call.get("id") is not None:  # a new call
            events = self._begin("function_call", {"id": item_id("fc"), "type": "function_call",
                                                   "call_id": call["id"], "name": fn.get("name", ""),
                                                   "arguments": "", "status": "in_progress"})
            self.calls[call["index"]] = len(self.items) - 1
        piece = fn.get("arguments") or ""
        if piece:
            k = self.calls[call["index"]]
            self.items[k]["arguments"] += piece
            events.append({"type": "response.function_call_arguments.delta", "item_id": self.items[k]["id"],
                           "output_index": k, "delta": piece})
        return events

    # ------------------------------------------------------------ the whole

    def reasoning_text(self) -> str:
        return "".join(i["content"][0]["text"] for i in self.items if i["type"] == "reasoning")
