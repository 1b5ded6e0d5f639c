"""The FastAPI application: routes of the native and OpenAI APIs over one Engine."""

from __future__ import annotations

import asyncio
import time
from importlib.metadata import version
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from starlette.responses import Response

from radixgen.common.http_errors import APIError, JSONResponse, install_error_handlers
from radixgen.common.prometheus import PROMETHEUS_CONTENT_TYPE
from radixgen.runtime.server.anthropic_api import ERROR_SHAPE as ANTHROPIC_ERRORS
from radixgen.runtime.server.anthropic_api import anthropic_router
from radixgen.runtime.server.api_errors import ErrorShapeMiddleware
from radixgen.runtime.server.console_api import console_router
from radixgen.runtime.server.kserve_api import ERROR_SHAPE as KSERVE_ERRORS
from radixgen.runtime.server.kserve_api import kserve_router
from radixgen.runtime.server.metrics import ServerMetrics
from radixgen.runtime.server.middleware import APIKeyMiddleware, RequestBodyMiddleware
from radixgen.runtime.server.native_api import NativeServing, native_router
from radixgen.runtime.server.native_protocol import AbortRequest
from radixgen.runtime.server.ollama_api import ERROR_SHAPE as OLLAMA_ERRORS
from radixgen.runtime.server.ollama_api import ollama_router
from radixgen.runtime.server.ollama_embed import ollama_embed_router
from radixgen.runtime.server.openai_api import OpenAIServing
from radixgen.runtime.server.pooling_api import pooling_router, refuse_generation
from radixgen.runtime.server.protocol import ChatCompletionRequest, CompletionRequest
from radixgen.runtime.server.responses_input import ResponsesRequest
from radixgen.runtime.server.serving import ClientGone, Dispatcher, KeyScopedEngine, new_rid

HEALTH_GENERATE_TIMEOUT_S = 60.0
DEFAULT_MAX_REQUEST_BYTES = 32 * 2**20
CACHE_ISOLATION = ("shared", "per-key")


def create_app(
    engine: Any,
    served_model_name: str | None = None,
    api_key: str | None = None,
    server_args: dict | None = None,
    *,
    api_keys: tuple[str, ...] | list[str] = (),
    cache_isolation: str = "shared",
    strict_model_name: bool = False,
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
    reasoning_parser: str | None = None,
    tool_call_parser: str | None = None,
) -> FastAPI:
    """The app over `engine`. Clients must send one of `api_key` / `api_keys` when any is given; with
    cache_isolation "per-key" each key's requests share cached prefixes only among themselves (see
    docs/security.md). `server_args` is what /get_server_info shows (no keys in it). `reasoning_parser` /
    `tool_call_parser`: the chat output formats (server/parsers); None: detected from the chat template."""
    keys = list(dict.fromkeys([*([api_key] if api_key else []), *api_keys]))
    if cache_isolation not in CACHE_ISOLATION:
        raise ValueError(f"cache_isolation must be one of {list(CACHE_ISOLATION)}, got {cache_isolation!r}")
    if cache_isolation == "per-key" and not keys:
        raise ValueError("cache_isolation 'per-key' needs API keys (--api-key or --api-key-file)")
    if max_request_bytes < 1:
        raise ValueError(f"max_request_bytes must be >= 1, got {max_request_bytes}")
    metrics = ServerMetrics()
    if cache_isolation == "per-key":  # every generation request is salted with its key's namespace
        engine = KeyScopedEngine(engine)
    dispatcher = Dispatcher(engine, metrics)
    name = served_model_name or Path(str(engine.model_info.get("model_name") or "default")).name
    openai = OpenAIServing(engine, dispatcher, name, strict_model_name, reasoning_parser, tool_call_parser)
    native = NativeServing(engine, dispatcher, openai)

    app = FastAPI(title="radixgen", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.engine = engine
    app.state.dispatcher = dispatcher
    app.state.metrics = metrics
    def count_error(status: int) -> None:
        metrics.errors.inc(status=str(status))

    install_error_handlers(app, on_error=count_error)
    refuse_generation(app, engine)  # an embedding model or a reranker: 400 on the generation routes
    app.add_middleware(RequestBodyMiddleware, max_bytes=max_request_bytes, on_error=count_error)
    if keys:  # added after the body middleware: runs before it (an unauthenticated body is not even read)
        app.add_middleware(APIKeyMiddleware, api_keys=keys, per_key=cache_isolation == "per-key", on_error=count_error)
    # outermost: the errors of the Anthropic / Ollama / KServe v2 paths in their own API's shape
    app.add_middleware(ErrorShapeMiddleware, shapes=[ANTHROPIC_ERRORS, OLLAMA_ERRORS, KSERVE_ERRORS])

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

    async def server_info_doc() -> dict:
        info = await server_info()
        info["http"] = {"served_model_name": name, "active_requests": len(dispatcher.active)}
        # SGLang's clients read the scheduler state from `internal_states`
        return {**info, "server_args": server_args or {}, "internal_states": [dict(info)],
                "version": version("radixgen")}

    # /generate, /tokenize, /detokenize, /get_model_info, /server_info, /get_load, /flush_cache...
    app.include_router(native_router(native, server_info_doc))

    app.include_router(console_router(engine, name))  # the web console at / and the /v1/radix_tree it polls

    @app.post("/abort_request")
    async def abort_request(req: AbortRequest):
        # with isolated keys, a key aborts its own requests only
        return JSONResponse({"rid": req.rid, "aborted": dispatcher.abort_for_caller(req.rid, req.abort_all)})

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

    @app.post("/v1/responses")
    async def responses(req: ResponsesRequest, request: Request):
        metrics.requests.inc(api="responses")
        return await openai.responses_api.create(req, request)

    @app.get("/v1/responses/{response_id}")
    async def retrieve_response(response_id: str):
        return JSONResponse(openai.responses_api.retrieve(response_id))

    @app.delete("/v1/responses/{response_id}")
    async def delete_response(response_id: str):
        return JSONResponse(openai.responses_api.delete(response_id))

    # ------------------------------------------------------------ other APIs, on the same paths (adapters)

    app.include_router(anthropic_router(openai, metrics))  # /v1/messages, /v1/messages/count_tokens
    app.include_router(ollama_router(openai, metrics))  # /api/chat, /api/generate, /api/tags, /api/show...
    app.include_router(kserve_router(openai, metrics))  # /v2/...: KServe v2 and Triton's generate extension
    app.include_router(pooling_router(engine, name))  # /v1/embeddings, /v1/rerank, /v1/score
    app.include_router(ollama_embed_router(engine))  # Ollama's /api/embed

    return app
