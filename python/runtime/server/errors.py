"""Every error leaves the server in the OpenAI shape: {"error": {"message", "type", "param", "code"}}."""

from __future__ import annotations

from typing import Any

import orjson
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import Response

# OpenAI's error `type` strings by status class.
_TYPES = {400: "invalid_request_error", 401: "invalid_request_error", 404: "invalid_request_error"}


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


def error_body(status: int, message: str, param: str | None = None, code: str | None = None) -> dict:
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
        loc = [str(x) for x in err.get("loc", ()) if x != "body"]
        if param is None and loc:
            param = loc[0]
        where = ".".join(loc) or "body"
        parts.append(f"{where}: {err.get('msg', 'invalid')}")
    return "; ".join(parts) or "invalid request", param


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError):
        return JSONResponse(exc.body(), status_code=exc.status)

    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, exc: RequestValidationError):
        message, param = _validation_message(exc)
        return error_response(400, message, param)

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException):
        code = "not_found" if exc.status_code == 404 else None
        return error_response(exc.status_code, str(exc.detail), None, code)

    @app.exception_handler(ValueError)
    async def _value(_: Request, exc: ValueError):
        message = str(exc)
        return error_response(400, message, value_error_param(message))

    @app.exception_handler(Exception)
    async def _unexpected(_: Request, exc: Exception):
        return error_response(500, f"internal error: {type(exc).__name__}: {exc}")
