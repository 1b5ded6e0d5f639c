"""ASGI middleware of the app: API keys (one or several, each optionally its own cache namespace) and
request bodies (read as JSON whatever the Content-Type, capped in size and in nesting depth, refused when
they hold a lone UTF-16 surrogate). Plain ASGI, so that streamed responses pass through untouched."""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import re
from collections.abc import Callable
from contextvars import ContextVar

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from radixgen.common.http_errors import error_response
from radixgen.common.nesting import MAX_BODY_DEPTH, text_depth

OPEN_PATHS = frozenset({"/health", "/", "/v2/health/live", "/v2/health/ready"})  # liveness probes carry no secrets,
OPEN_PREFIXES = ("/console/",)  # nor does the web console's static page (it asks for the key to call the API)
BODY_METHODS = frozenset({"POST", "PUT", "PATCH"})

# The cache namespace of the API key that sent the request being handled (per-key cache isolation);
# None when every client shares one radix tree.
KEY_NAMESPACE: ContextVar[str | None] = ContextVar("radixgen_key_namespace", default=None)

OnError = Callable[[int], None]  # counts a refusal made here by its status (the app's handlers never see it)


def _ignore(status: int) -> None:
    pass


def key_namespace(key: str) -> str:
    """A key's cache namespace: a digest, so that the key itself never travels to the scheduler."""
    return "key-" + hashlib.sha256(key.encode()).hexdigest()[:24]


def is_open_path(path: str) -> bool:
    return path in OPEN_PATHS or path.startswith(OPEN_PREFIXES)


class APIKeyMiddleware:
    """401 (OpenAI shape) unless `Authorization: Bearer <key>` (or `x-api-key: <key>`, as Anthropic's clients
    send it) names one of the keys. With `per_key`,
    the request runs with KEY_NAMESPACE set to its key's namespace."""

    def __init__(self, app: ASGIApp, api_keys: list[str], per_key: bool = False, on_error: OnError = _ignore):
        self.app = app
        self.on_error = on_error
        self.expected = [(b"Bearer " + k.encode(), key_namespace(k) if per_key else None) for k in api_keys]

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or is_open_path(scope["path"]):
            await self.app(scope, receive, send)
            return
        headers = dict(scope["headers"])
        # Authorization: Bearer <key>, or Anthropic's x-api-key: <key>
        given = [headers.get(b"authorization", b""), b"Bearer " + headers.get(b"x-api-key", b"")]
        # every key is compared (constant time each), so the time taken does not tell which one matched
        matches = [ns for expected, ns in self.expected for g in given if hmac.compare_digest(g, expected)]
        if not matches:
            self.on_error(401)
            response = error_response(
                401, "Incorrect or missing API key (send Authorization: Bearer <key> or x-api-key: <key>).", None,
                "invalid_api_key",
            )
            await response(scope, receive, send)
            return
        token = KEY_NAMESPACE.set(matches[0])
        try:
            await self.app(scope, receive, send)
        finally:
            KEY_NAMESPACE.reset(token)


def scoped_cache_salt(cache_salt: str | None) -> str | None:
    """The cache salt a request runs with: its own, inside its API key's namespace when keys are isolated."""
    namespace = KEY_NAMESPACE.get()
    if namespace is None:
        return cache_salt
    return namespace if cache_salt is None else f"{namespace}/{cache_salt}"


# A \uXXXX escape of a UTF-16 surrogate, with the backslashes before it (an even count escapes them all).
_SURROGATE_ESCAPE = re.compile(rb"(\\+)u([dD][89abAB]|[dD][c-fC-F])([0-9a-fA-F]{2})")


def lone_surrogate(body: bytes) -> str | None:
    """The first lone surrogate escape (e.g. "\\ud800") of a JSON text, or None. A high surrogate is
    fine only directly followed by a low one (the two make one character)."""
    if b"\\u" not in body:
        return None
    escapes = [m for m in _SURROGATE_ESCAPE.finditer(body) if len(m.group(1)) % 2 == 1]
    i = 0
    while i < len(escapes):
        m = escapes[i]
        high = m.group(2)[1:2].lower() in b"89ab"
        nxt = escapes[i + 1] if i + 1 < len(escapes) else None
        if high and nxt is not None and nxt.start() == m.end() and nxt.group(2)[1:2].lower() in b"cdef":
            i += 2
            continue
        return "\\u" + (m.group(2) + m.group(3)).decode().lower()
    return None


class RequestBodyMiddleware:
    """Every body of this API is JSON: read it as such whatever the Content-Type says (curl -d sends
    application/x-www-form-urlencoded). A body over `max_bytes` is a 413, judged from Content-Length when
    given and by counting otherwise, before anything is parsed; a body with a lone surrogate (not valid
    Unicode: no tokenizer can take it) is a 400. The body is read here once and handed on whole."""

    def __init__(self, app: ASGIApp, max_bytes: int, on_error: OnError = _ignore):
        self.app = app
        self.max_bytes = max_bytes
        self.on_error = on_error

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] not in BODY_METHODS:
            await self.app(scope, receive, send)
            return
        headers = [(k, v) for k, v in scope["headers"] if k != b"content-type"]
        scope = {**scope, "headers": [*headers, (b"content-type", b"application/json")]}
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None:
            if not declared.isdigit():
                await self._refuse(400, "the Content-Length header is not a number", None, scope, receive, send)
                return
            if int(declared) > self.max_bytes:
                await self._too_large(int(declared), scope, receive, send)
                return
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return  # the client left before sending its body: nobody to answer
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_bytes:
                await self._too_large(None, scope, receive, send)
                return
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        body = b"".join(chunks)
        bad = lone_surrogate(body)
        if bad is not None:
            message = (
                f"the request body holds a lone UTF-16 surrogate ({bad}), which is not valid Unicode; "
                "strings must be valid Unicode text"
            )
            await self._refuse(400, message, None, scope, receive, send)
            return
        if body.count(b"[") + body.count(b"{") > MAX_BODY_DEPTH and await _body_depth(body) > MAX_BODY_DEPTH:
            message = (f"the request body nests objects and arrays deeper than the limit of {MAX_BODY_DEPTH} "
                       "levels")
            await self._refuse(400, message, "too_deeply_nested", scope, receive, send)
            return
        await self.app(scope, _replay(body, receive), send)

    async def _too_large(self, declared: int | None, scope: Scope, receive: Receive, send: Send) -> None:
        size = f"{declared} bytes" if declared is not None else f"more than {self.max_bytes} bytes"
        message = (
            f"the request body is too large: {size}; this server accepts at most {self.max_bytes} bytes"
            " (--max-request-bytes)"
        )
        await self._refuse(413, message, "request_too_large", scope, receive, send)

    async def _refuse(self, status: int, message: str, code: str | None, scope: Scope, receive: Receive, send: Send):
        self.on_error(status)
        await error_response(status, message, None, code)(scope, receive, send)


async def _body_depth(body: bytes) -> int:
    """text_depth, off the event loop for a large body (a linear scan, but of up to --max-request-bytes)."""
    return text_depth(body) if len(body) < 1 << 20 else await asyncio.to_thread(text_depth, body)


def _replay(body: bytes, receive: Receive) -> Receive:
    """The body as one message, then the client's own messages (a disconnect, for the handlers' watch)."""
    sent = False

    async def replayed() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replayed
