"""The FastAPI application: routes of the native and OpenAI APIs over one Engine."""

from __future__ import annotations

import asyncio
import hmac
import time
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from starlette.responses import Response
from starlette.types import ASGIApp, Receive, Scope, Send

from radixgen.runtime.server.errors import APIError, JSONResponse, error_response, install_error_handlers
from radixgen.runtime.server.metrics import PROMETHEUS_CONTENT_TYPE, ServerMetrics
from radixgen.runtime.server.native_api import NativeServing
from radixgen.runtime.server.openai_api import OpenAIServing
from radixgen.runtime.server.protocol import (
    AbortRequest,
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    GenerateRequest,
    TokenizeRequest,
)
from radixgen.runtime.server.serving import ClientGone, Dispatcher, new_rid

HEALTH_GENERATE_TIMEOUT_S = 60.0
OPEN_PATHS = frozenset({"/health"})  # answer without the API key: liveness probes carry no secrets


class APIKeyMiddleware:
    """401 (OpenAI shape) unless `Authorization: Bearer <key>`; plain ASGI so streams are untouched."""

    def __init__(self, app: ASGIApp, api_key: str):
        self.app = app
        self.expected = b"Bearer " + api_key.encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"] not in OPEN_PATHS:
            given = dict(scope["headers"]).get(b"authorization", b"")
            if not hmac.compare_digest(given, self.expected):
                response = error_response(
                    401,
                    "Incorrect or missing API key (send Authorization: Bearer <key>).",
                    None,
                    "invalid_api_key",
                )
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


class JSONBodyMiddleware:
    """Every POST body of this API is JSON: read it as such whatever the Content-Type says (curl -d
    sends application/x-www-form-urlencoded)."""

    def __init__(self, app: ASGIApp):
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["method"] == "POST":
            headers = [(k, v) for k, v in scope["headers"] if k != b"content-type"]
            scope = {**scope, "headers": [*headers, (b"content-type", b"application/json")]}
        await self.app(scope, receive, send)


def create_app(
    engine: Any,
    served_model_name: str | None = None,
    api_key: str | None = None,
    server_args: dict | None = None,
) -> FastAPI:
    metrics = ServerMetrics()
    dispatcher = Dispatcher(engine, metrics)
    name = served_model_name or Path(str(engine.model_info.get("model_name") or "default")).name
    openai = OpenAIServing(engine, dispatcher, name)
    native = NativeServing(engine, dispatcher, openai)

    app = FastAPI(title="radixgen", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.engine = engine
    app.state.dispatcher = dispatcher
    app.state.metrics = metrics
    install_error_handlers(app, on_error=lambda status: metrics.errors.inc(status=str(status)))
    app.add_middleware(JSONBodyMiddleware)
    if api_key:  # added last: runs first
        app.add_middleware(APIKeyMiddleware, api_key=api_key)

    @app.exception_handler(ClientGone)
    async def _gone(_: Request, __: ClientGone):
        return Response(status_code=499)  # nobody reads it; the engine requests are already aborted

    async def server_info() -> dict:
        # off the event loop: a round trip to the scheduler must not stall the streams
        return await asyncio.to_thread(engine.get_server_info)

    # ------------------------------------------------------------ native API

    @app.get("/health")
    async def health():
        if not engine.is_alive:
            raise APIError(503, "the scheduler process is not running", None, "scheduler_gone")
        return JSONResponse({"status": "ok"})

    @app.get("/health_generate")
    async def health_generate():
        if not engine.is_alive:
            raise APIError(503, "the scheduler process is not running", None, "scheduler_gone")
        bos = engine.model_info.get("bos_token_id")
        ids = [bos if bos is not None else 0]
        rid = new_rid("health-")
        call = engine.async_generate(input_ids=ids, sampling_params={"max_new_tokens": 1}, rid=rid)
        try:  # a timeout cancels the call, which aborts the request
            await asyncio.wait_for(
                dispatcher.call([rid], time.perf_counter(), call), HEALTH_GENERATE_TIMEOUT_S
            )
        except (RuntimeError, asyncio.TimeoutError) as e:
            raise APIError(503, f"generation failed: {str(e) or 'timed out'}", None, "unhealthy") from e
        return JSONResponse({"status": "ok"})

    @app.get("/get_model_info")
    async def get_model_info():
        return JSONResponse(engine.model_info)

    @app.get("/get_server_info")
    async def get_server_info():
        info = await server_info()
        info["http"] = {"served_model_name": name, "active_requests": len(dispatcher.active)}
        return JSONResponse({**info, "server_args": server_args or {}})

    @app.post("/flush_cache")
    async def flush_cache():
        if not await asyncio.to_thread(engine.flush_cache):
            raise APIError(400, "the cache can only be flushed while no request is running", None, "busy")
        return JSONResponse({"success": True})

    @app.post("/abort_request")
    async def abort_request(req: AbortRequest):
        return JSONResponse({"rid": req.rid, "aborted": dispatcher.abort(req.rid)})

    @app.post("/generate")
    async def generate(req: GenerateRequest, request: Request):
        metrics.requests.inc(api="generate")
        return await native.generate(req, request)

    @app.post("/tokenize")
    async def tokenize(req: TokenizeRequest):
        return JSONResponse(native.tokenize(req))

    @app.post("/detokenize")
    async def detokenize(req: DetokenizeRequest):
        return JSONResponse(native.detokenize(req))

    @app.get("/metrics")
    async def get_metrics():
        if engine.is_alive:  # without a scheduler, the HTTP-side figures are still worth scraping
            metrics.update_from_server_info(await server_info())
        return Response(metrics.render(), media_type=PROMETHEUS_CONTENT_TYPE)

    # ------------------------------------------------------------ OpenAI API

    @app.get("/v1/models")
    async def list_models():
        return JSONResponse(openai.list_models())

    @app.get("/v1/models/{model_id:path}")
    async def retrieve_model(model_id: str):
        return JSONResponse(openai.retrieve_model(model_id))

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest, request: Request):
        metrics.requests.inc(api="completions")
        return await openai.completions(req, request)

    @app.post("/v1/chat/completions")
    async def chat_completions(req: ChatCompletionRequest, request: Request):
        metrics.requests.inc(api="chat")
        return await openai.chat(req, request)

    return app
