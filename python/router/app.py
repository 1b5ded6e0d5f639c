"""The router's FastAPI app: generation routes go to one worker by the policy; the rest fan out or go to
any healthy worker. Bodies are forwarded as bytes: workers validate them, and their 4xx come back as is."""

from __future__ import annotations

import asyncio
import contextlib
import hmac
from typing import Any

import httpx
import orjson
from fastapi import FastAPI, Request
from starlette.responses import Response
from starlette.types import ASGIApp, Receive, Scope, Send

from radixgen.common.console_static import add_console_static
from radixgen.common.http_errors import (
    APIError,
    JSONResponse,
    error_body,
    error_response,
    install_error_handlers,
)
from radixgen.router.config import RouterConfig
from radixgen.router.metrics import PROMETHEUS_CONTENT_TYPE, RouterMetrics
from radixgen.router.policies import RoundRobin, make_policy
from radixgen.router.proxy import Forwarder, Unserved, forward_headers, prompt_text, unserved_response, until_disconnect
from radixgen.router.workers import WorkerPool

OPEN_PATHS = frozenset({"/health", "/"})  # probes carry no key, nor does the web console's page
OPEN_PREFIXES = ("/console/",)  # the console's static files
GENERATION_ROUTES = {"/generate": "generate", "/v1/completions": "completions", "/v1/chat/completions": "chat"}
# upstream timeouts: generation may take as long as it takes (a client that gives up disconnects, which
# aborts the request); a worker that does not accept a connection in time is as good as down
UPSTREAM_TIMEOUT = httpx.Timeout(connect=5.0, read=None, write=60.0, pool=None)
FANOUT_TIMEOUT_S = 60.0


class APIKeyCheck:
    """401 (OpenAI shape) unless `Authorization: Bearer <one of the keys>`; plain ASGI, so relayed
    streams and disconnects pass untouched."""

    def __init__(self, app: ASGIApp, keys: tuple[str, ...]):
        self.app = app
        self.expected = [b"Bearer " + k.encode() for k in keys]

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope.get("path", "")
        if scope["type"] == "http" and path not in OPEN_PATHS and not path.startswith(OPEN_PREFIXES):
            given = dict(scope["headers"]).get(b"authorization", b"")
            if not any([hmac.compare_digest(given, e) for e in self.expected]):  # a list: compare with every key
                response = error_response(
                    401, "Incorrect or missing API key (send Authorization: Bearer <key>).", None, "invalid_api_key"
                )
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


class BodyLimit:
    """413 (OpenAI shape) for a body over `max_bytes`, judged from Content-Length when given and by counting
    the bytes as they arrive otherwise, before any of it is kept whole or forwarded."""

    def __init__(self, app: ASGIApp, max_bytes: int):
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] not in ("POST", "PUT", "PATCH"):
            await self.app(scope, receive, send)
            return
        declared = dict(scope["headers"]).get(b"content-length", b"")
        if declared.isdigit() and int(declared) > self.max_bytes:
            await self._refuse(scope, receive, send)
            return
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > self.max_bytes:
                await self._refuse(scope, receive, send)
                return
            if not message.get("more_body", False):
                break
        body, sent = b"".join(chunks), False

        async def replay() -> dict:
            nonlocal sent
            if sent:
                return await receive()
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}

        await self.app(scope, replay, send)

    async def _refuse(self, scope: Scope, receive: Receive, send: Send) -> None:
        message = f"the request body is too large: this router accepts at most {self.max_bytes} bytes " \
                  "(--max-request-bytes)"
        await error_response(413, message, None, "request_too_large")(scope, receive, send)


def create_router_app(args: RouterConfig, worker_urls: tuple[str, ...] = ()) -> FastAPI:
    policy = make_policy(args.policy, **args.cache_aware_options())
    any_worker = RoundRobin()  # for routes that need one worker, any one: they leave the policy's state alone
    metrics = RouterMetrics()
    # the client is created here (routes capture it) and closed when the app shuts down
    client = httpx.AsyncClient(
        timeout=UPSTREAM_TIMEOUT, limits=httpx.Limits(max_connections=None, max_keepalive_connections=256)
    )
    pool = WorkerPool(policy, client)
    for url in worker_urls:
        pool.add(url)
    forwarder = Forwarder(pool, client, metrics)

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI):
        checks = asyncio.ensure_future(pool.run_health_checks(args.health_check_interval))
        try:
            yield
        finally:
            checks.cancel()
            await asyncio.gather(checks, return_exceptions=True)
            await client.aclose()

    app = FastAPI(title="radixgen router", docs_url=None, redoc_url=None, openapi_url=None, lifespan=lifespan)
    app.state.pool = pool
    app.state.policy = policy
    app.state.metrics = metrics
    install_error_handlers(app)

    app.add_middleware(BodyLimit, max_bytes=args.max_request_bytes)
    if args.api_keys:  # added last: runs first (an unauthenticated body is not even read)
        app.add_middleware(APIKeyCheck, keys=args.api_keys)

    async def forward(request: Request, path: str, text: str, route: str, chooser) -> Response:
        body = await request.body()
        target = f"{path}?{request.url.query}" if request.url.query else path
        work = forwarder.open(chooser, request.method, target, body, forward_headers(request), text, route)
        try:
            connected, up = await until_disconnect(request, work)
        except Unserved as e:
            return unserved_response(e)
        if not connected:  # the client left while the worker worked: the cancelled attempt closed its upstream
            return Response(status_code=499)
        response = forwarder.respond(up)
        if not up.streamed:
            await forwarder.release(up)
        return response

    async def generation(request: Request) -> Response:
        body = await request.body()
        try:
            payload = orjson.loads(body)
        except orjson.JSONDecodeError:
            payload = None  # the worker answers the 400
        route = GENERATION_ROUTES[request.url.path]
        return await forward(request, request.url.path, prompt_text(payload), route, policy)

    for path in GENERATION_ROUTES:
        app.add_api_route(path, generation, methods=["POST"])

    async def to_any(request: Request) -> Response:
        return await forward(request, request.url.path, "", "other", any_worker)

    for path in ("/v1/models", "/v1/models/{model_id:path}", "/get_model_info"):
        app.add_api_route(path, to_any, methods=["GET"])
    for path in ("/tokenize", "/detokenize"):
        app.add_api_route(path, to_any, methods=["POST"])

    async def fan_out(request: Request, method: str, path: str) -> list[dict[str, Any]]:
        """The same call to every healthy worker; one result per worker (status, body or error)."""
        body = await request.body()
        headers = forward_headers(request)

        async def one(url: str) -> dict[str, Any]:
            try:
                r = await client.request(method, url + path, content=body, headers=headers, timeout=FANOUT_TIMEOUT_S)
            except httpx.HTTPError as e:
                return {"url": url, "status": None, "error": f"{type(e).__name__}: {e}"}
            try:
                return {"url": url, "status": r.status_code, "body": r.json()}
            except ValueError:
                return {"url": url, "status": r.status_code, "body": r.text[:1000]}

        return await asyncio.gather(*(one(w.url) for w in pool.healthy()))

    @app.get("/health")
    async def health():
        healthy = len(pool.healthy())
        if not healthy:
            raise APIError(503, f"no healthy worker (of {len(pool.workers)})", None, "no_healthy_worker")
        return JSONResponse({"status": "ok", "healthy_workers": healthy, "workers": len(pool.workers)})

    @app.post("/flush_cache")
    async def flush_cache(request: Request):
        results = await fan_out(request, "POST", "/flush_cache")
        if not results:
            raise APIError(503, "no healthy worker to flush", None, "no_healthy_worker")
        failed = [r for r in results if r["status"] != 200]
        if not failed:
            return JSONResponse({"success": True, "workers": results})
        status = 400 if all(r["status"] == 400 for r in failed) else 503
        names = ", ".join(r["url"] for r in failed)
        message = f"flush_cache failed on {len(failed)} of {len(results)} workers: {names}"
        body = error_body(status, message, None, "worker_error")
        return JSONResponse({**body, "workers": results}, status_code=status)

    async def lora_update(request: Request) -> Response:
        """A LoRA load or unload on every worker (each serves every adapter); its success needs all of them."""
        results = await fan_out(request, "POST", request.url.path)
        if not results:
            raise APIError(503, "no healthy worker", None, "no_healthy_worker")
        failed = [r for r in results if r["status"] != 200]
        if not failed:
            return JSONResponse({"success": True, "error_message": None,
                                 "loaded_adapters": results[0]["body"].get("loaded_adapters"), "workers": results})
        status = 400 if all(r["status"] == 400 for r in failed) else 503
        first = failed[0].get("body")
        detail = first.get("error_message") if isinstance(first, dict) else failed[0].get("error")
        message = f"{request.url.path} failed on {len(failed)} of {len(results)} workers: {detail}"
        body = error_body(status, message, None, "worker_error")
        return JSONResponse({**body, "success": False, "error_message": message, "workers": results},
                            status_code=status)

    for path in ("/load_lora_adapter", "/unload_lora_adapter"):
        app.add_api_route(path, lora_update, methods=["POST"])

    @app.post("/abort_request")
    async def abort_request(request: Request):
        results = await fan_out(request, "POST", "/abort_request")
        aborted = any(isinstance(r.get("body"), dict) and r["body"].get("aborted") for r in results)
        return JSONResponse({"aborted": aborted, "workers": results})

    @app.get("/get_server_info")
    async def get_server_info(request: Request):
        results = {r["url"]: r for r in await fan_out(request, "GET", "/get_server_info")}
        workers = []
        for w in pool.workers.values():
            r = results.get(w.url, {})
            workers.append(
                {
                    **worker_state(w),
                    "server_info": r.get("body") if r.get("status") == 200 else None,
                    "error": r.get("error") or (r.get("body") if r and r.get("status") != 200 else None),
                }
            )
        return JSONResponse({"router": args.public(), "workers": workers})

    @app.get("/metrics")
    async def get_metrics():
        return Response(metrics.render(pool), media_type=PROMETHEUS_CONTENT_TYPE)

    add_console_static(app)  # the web console, drawing every worker's tree

    @app.get("/v1/radix_tree")
    async def radix_tree(request: Request):
        """Each worker's /v1/radix_tree document (the same query and key), one entry per worker."""
        path = f"/v1/radix_tree?{request.url.query}" if request.url.query else "/v1/radix_tree"
        results = {r["url"]: r for r in await fan_out(request, "GET", path)}
        ok = [r for r in results.values() if r["status"] == 200]
        if results and not ok and all(r["status"] in (400, 401) for r in results.values()):
            first = results[next(iter(results))]  # every worker refused the same query: its error, as is
            return JSONResponse(first["body"], status_code=first["status"])
        workers = []
        for w in pool.workers.values():
            r = results.get(w.url, {})
            error = r.get("error") or (r["body"] if r and r["status"] != 200 else None) or (
                None if r else "not healthy")
            workers.append({**worker_state(w), "doc": r["body"] if r.get("status") == 200 else None, "error": error})
        return JSONResponse({"object": "radix_tree_list", "workers": workers})

    def worker_state(w) -> dict[str, Any]:
        return {"url": w.url, "healthy": w.healthy, "in_flight": w.in_flight, "last_error": w.last_error}

    @app.get("/list_workers")
    async def list_workers():
        return JSONResponse({"workers": [worker_state(w) for w in pool.workers.values()]})

    @app.post("/add_worker")
    async def add_worker(url: str):
        try:
            worker = pool.add(url)
        except ValueError as e:
            raise APIError(400, str(e), "url") from e
        await pool.check(worker)  # joins the rotation now if it is healthy, else at a later check
        return JSONResponse(worker_state(worker))

    @app.post("/remove_worker")
    async def remove_worker(url: str):
        try:
            worker = pool.remove(url)
        except ValueError as e:
            raise APIError(400, str(e), "url") from e
        except KeyError as e:
            raise APIError(404, e.args[0], "url", "not_found") from e
        return JSONResponse({**worker_state(worker), "removed": True})

    return app
