"""Every error leaves the server in the OpenAI shape: {"error": {"message", "type", "param", "code"}}."""

from __future__ import annotations

import logging
import os
import re
import sys
from collections.abc import Callable
from typing import Any

import orjson
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import Response

logger = logging.getLogger("radixgen.server")

# OpenAI's error `type` strings by status class.
_TYPES = {400: "invalid_request_error", 401: "invalid_request_error", 404: "invalid_request_error"}
_TRACEBACK = re.compile(r"Traceback \(most recent call last\)|^\s*File \"", re.M)
_PATH = re.compile(r"(?:[A-Za-z]:)?(?:[\\/][\w.+-]+){2,}")
# What of a message is the server's own, at any status: a native library's log prefix ("[17:35:00]
# /project/cpp/x.cc:82: ") and a path to a source file or into the server's installation / working folder.
_LOG_PREFIX = re.compile(r"\[[\d:.]+\] \S+?:\d+: ")
_SOURCE = re.compile(r"(?:[A-Za-z]:)?(?:[\\/][\w.+-]+)+\.(?:py|pyc|pyx|c|cc|cpp|cxx|h|hpp|cu|so)\b(?::\d+)?")
_ROOTS = tuple(dict.fromkeys(r for r in (
    os.path.dirname(os.path.dirname(os.path.abspath(__file__))), sys.prefix, sys.base_prefix, os.getcwd(),
) if len(r) > 1))
_OWN_PATH = re.compile("(?:" + "|".join(re.escape(r) for r in _ROOTS) + r")(?:[\\/][\w.+-]+)*")


class JSONResponse(Response):
    """orjson-encoded JSON (fast; tuples become lists; NaN becomes null)."""

    media_type = "application/json"

    def render(self, content: Any) -> bytes:
        return orjson.dumps(content)


class APIError(Exception):
    """An error with its HTTP status; raised anywhere in a handler, rendered by the app."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code

    def body(self) -> dict[str, Any]:
        return error_body(self.status, self.message, self.param, self.code)


def public_message(message: str, status: int) -> str:
    """What of an error message a client may see: never a traceback, a source path or a path into the
    server's own installation (those go to the log). A traceback is reduced to its last line (the
    exception), and a 5xx message to one line."""
    cut = _TRACEBACK.search(message)
    hidden = cut is not None or status == 500  # something for the log only
    if cut is not None:
        head = message[: cut.start()].strip().rstrip(":").strip()
        tail = [line.strip() for line in message[cut.start() :].splitlines() if line.strip()]
        last = tail[-1] if tail and not tail[-1].startswith(("File ", "Traceback ")) else ""
        message = ": ".join(x for x in (head, last) if x)
    message = _OWN_PATH.sub("<path>", _SOURCE.sub("<source>", _LOG_PREFIX.sub("", message)))
    if status >= 500:
        message = _PATH.sub("<path>", message.strip().split("\n", 1)[0])
        message = (message or "internal error") + (" (details are in the server log)" if hidden else "")
    return message.strip() or "invalid request"


def error_body(status: int, message: str, param: str | None = None, code: str | None = None) -> dict:
    message = public_message(message, status)
    kind = _TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def error_response(status: int, message: str, param: str | None = None, code: str | None = None):
    return JSONResponse(error_body(status, message, param, code), status_code=status)


def bad_request(message: str, param: str | None = None) -> APIError:
    return APIError(400, message, param)


def value_error_param(message: str) -> str | None:
    """The field a ValueError names first ("sampling_params.top_p: ..." -> "top_p"), if any."""
    head = message.split(":", 1)[0].strip()
    if " " in head or not head:
        return None
    return head.rsplit(".", 1)[-1]


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    parts, param = [], None
    for err in exc.errors():
        if err.get("type") == "json_invalid":
            return f"the request body is not valid JSON: {err.get('ctx', {}).get('error', '')}".strip(), None
        loc = [str(x) for x in err.get("loc", ()) if x != "body"]
        msg = str(err.get("msg", "invalid")).removeprefix("Value error, ")
        if not loc:  # a check across fields: its message names the field first ("seed: ...")
            param = param or value_error_param(msg)
            parts.append(msg)
            continue
        if param is None:
            param = loc[0]
        parts.append(f"{'.'.join(loc)}: {msg}")
    return "; ".join(parts) or "invalid request", param


def error_of(exc: BaseException) -> APIError:
    """The API error an exception stands for: ValueError (bad input, also from the Engine) -> 400,
    RuntimeError (the scheduler died or the engine is shut down) -> 503, anything else -> 500."""
    if isinstance(exc, APIError):
        err = exc
    elif isinstance(exc, ValueError):
        err = APIError(400, str(exc), value_error_param(str(exc)))
    elif isinstance(exc, RecursionError):  # a walker a nesting limit missed: the input's fault, not the server's
        logger.error("RecursionError on a request: a nesting limit is missing", exc_info=exc)
        err = APIError(400, "the request nests too deeply to be processed", None, "too_deeply_nested")
    elif isinstance(exc, RuntimeError):  # one may say which status and code (a full fetch pool: media_fetch_busy)
        err = APIError(getattr(exc, "status", 503), str(exc), None, getattr(exc, "code", "engine_unavailable"))
    else:
        err = APIError(500, f"internal error: {type(exc).__name__}: {exc}", None, "internal_error")
    if err.status >= 500:  # the whole story goes to the log; the client gets public_message's summary
        level = logging.ERROR if err.status == 500 else logging.WARNING
        logger.log(level, "HTTP %d: %s", err.status, err.message, exc_info=exc if err is not exc else None)
    return err


def install_error_handlers(app: FastAPI, on_error: Callable[[int], None] = lambda status: None) -> None:
    """Route every failure to an OpenAI-shaped body; `on_error(status)` counts them."""

    def respond(status: int, message: str, param: str | None = None, code: str | None = None):
        on_error(status)
        return error_response(status, message, param, code)

    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError):
        return respond(exc.status, exc.message, exc.param, exc.code)

    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, exc: RequestValidationError):
        message, param = _validation_message(exc)
        return respond(400, message, param)

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException):
        code = "not_found" if exc.status_code == 404 else None
        return respond(exc.status_code, str(exc.detail), None, code)

    @app.exception_handler(ValueError)
    @app.exception_handler(RuntimeError)
    @app.exception_handler(Exception)
    async def _other(_: Request, exc: Exception):
        err = error_of(exc)
        return respond(err.status, err.message, err.param, err.code)
