"""What the OpenAI handlers share below the request level: engine jobs, SSE framing, logprob values."""

from __future__ import annotations

import math
from collections.abc import AsyncIterator, Callable
from typing import Any, NamedTuple

import orjson
from starlette.responses import StreamingResponse

FLOOR_LOGPROB = -9999.0  # what -inf becomes: JSON has no infinities
SSE_DONE = b"data: [DONE]\n\n"


class Job(NamedTuple):
    """One engine request: prompt `prompt` of the API request, choice `choice` of its n."""

    index: int  # the OpenAI choice index: prompt * n + choice
    prompt: int
    rid: str
    kwargs: dict[str, Any]


def sse(obj: Any) -> bytes:
    return b"data: " + orjson.dumps(obj) + b"\n\n"


class EventStream(StreamingResponse):
    """An SSE response that closes its body generator however the response ends (so the generator's
    cleanup runs at once), then calls `cleanup` (which aborts whatever of the request still runs)."""

    def __init__(self, content: AsyncIterator[bytes], cleanup: Callable[[], Any]):
        super().__init__(content, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        self.cleanup = cleanup

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.body_iterator.aclose()
            self.cleanup()


def json_logprob(x: float | None) -> float | None:
    if x is None:
        return None
    return FLOOR_LOGPROB if math.isinf(x) or math.isnan(x) else x


def finish_reason_of(meta: dict) -> str:
    """The OpenAI finish_reason of an engine result: "stop", "length", or "abort" (by /abort_request or
    at shutdown; requests the runtime rejects raise in the engine instead)."""
    return (meta.get("finish_reason") or {}).get("type", "abort")
