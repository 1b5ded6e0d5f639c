"""Errors in each API's own shape. Every failure is raised and rendered once, in the OpenAI shape
(common/http_errors.py, the API-key and body-size middleware included); for the paths of another API
(Anthropic's /v1/messages, Ollama's /api/, KServe v2's /v2) this middleware, the outermost, rewrites such
a body into that API's shape with the same status. Streams report their own errors in their own framing
(the status line is sent by then); a body that is not an OpenAI error passes through untouched."""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import orjson
from starlette.types import ASGIApp, Message, Receive, Scope, Send

# (status, message, code) -> the API's error body
Shaper = Callable[[int, str, "str | None"], dict]


class ErrorShape(NamedTuple):
    prefix: str  # a path equal to it or below it ("/v2" covers "/v2" and "/v2/...")
    shape: Shaper

    def covers(self, path: str) -> bool:
        return path == self.prefix or path.startswith(self.prefix.rstrip("/") + "/")


def reshape(body: bytes, status: int, shape: Shaper) -> bytes | None:
    """The API's body for an OpenAI-shaped error body, or None when `body` is not one."""
    try:
        err = orjson.loads(body)["error"]
        message, code = err["message"], err.get("code")
    except (orjson.JSONDecodeError, KeyError, TypeError):
        return None
    if not isinstance(message, str):
        return None
    return orjson.dumps(shape(status, message, code))


class ErrorShapeMiddleware:
    def __init__(self, app: ASGIApp, shapes: list[ErrorShape]):
        self.app = app
        self.shapes = shapes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        shape = None
        if scope["type"] == "http":
            shape = next((s.shape for s in self.shapes if s.covers(scope["path"])), None)
        if shape is None:
            await self.app(scope, receive, send)
            return
        start: Message | None = None
        chunks: list[bytes] = []

        async def shaped_send(message: Message) -> None:
            nonlocal start
            if message["type"] == "http.response.start" and message["status"] >= 400:
                start = message  # an error body is small: held until it is whole, then rewritten
                return
            if start is None or message["type"] != "http.response.body":
                await send(message)
                return
            chunks.append(message.get("body", b""))
            if message.get("more_body", False):
                return
            body = b"".join(chunks)
            new = reshape(body, start["status"], shape)
            headers = list(start.get("headers", []))
            if new is not None:
                body = new
                headers = [(k, v) for k, v in headers if k.lower() not in (b"content-length", b"content-type")]
                headers += [(b"content-length", str(len(body)).encode()), (b"content-type", b"application/json")]
            await send({**start, "headers": headers})
            await send({"type": "http.response.body", "body": body, "more_body": False})

        await self.app(scope, receive, shaped_send)
