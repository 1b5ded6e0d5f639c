"""Forwarding one request to a worker: choose, send, retry what failed before its first byte, relay.

A request is retried on another worker while nothing of it has reached the client: a connection that
fails, a worker that answers 5xx, a stream that ends before its first chunk. Once a byte is relayed the
request belongs to that worker; if the worker then dies, the stream ends with an error event."""

from __future__ import annotations

import asyncio
import hashlib
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, NamedTuple

import httpx
import orjson
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from radixgen.common.http_errors import error_body
from radixgen.router.metrics import RouterMetrics
from radixgen.router.policies import Policy
from radixgen.router.workers import Worker, WorkerPool

# request headers that describe the router's connection, not the request (httpx sets its own)
_HOP_HEADERS = frozenset(
    {"host", "content-length", "connection", "keep-alive", "transfer-encoding", "accept-encoding", "upgrade", "te"}
)
# response headers the router's own response framing replaces
_DROP_RESPONSE_HEADERS = frozenset({"content-length", "transfer-encoding", "connection", "date", "server"})


class Unserved(Exception):
    """No healthy worker could take the request; `failures` says what each attempt got."""

    def __init__(self, failures: list[str]):
        self.failures = failures
        why = "; ".join(failures) if failures else "no worker is healthy"
        super().__init__(f"no worker could serve the request ({why})")


def unserved_response(exc: Unserved) -> Response:
    body = error_body(503, str(exc), None, "workers_failed" if exc.failures else "no_healthy_worker")
    return Response(orjson.dumps(body), status_code=503, media_type="application/json")


class Upstream(NamedTuple):
    worker: Worker
    response: httpx.Response
    first: bytes  # the whole body when not streamed; else the first chunk
    chunks: AsyncIterator[bytes]  # the rest of a streamed body
    streamed: bool  # an event stream, relayed chunk by chunk


def forward_headers(request: Request) -> dict[str, str]:
    """The client's headers minus the hop-by-hop ones: its Authorization reaches the worker unchanged."""
    return {k: v for k, v in request.headers.items() if k.lower() not in _HOP_HEADERS}


def response_headers(response: httpx.Response) -> dict[str, str]:
    return {k: v for k, v in response.headers.items() if k.lower() not in _DROP_RESPONSE_HEADERS}


def prompt_text(payload: Any) -> str:
    """The text a request's prompt starts with, for prefix matching: chat messages serialized in order,
    else `text` / `prompt` / `input_ids` (a batch: its prompts one after another), led by the LoRA adapter
    or model it names (a worker caches each adapter's prefixes apart). Images count by a digest of their
    source (`image_key`), as a worker keys an image's tokens by its pixels: a chat message's image_url part in
    its place; /generate's `image_data` ahead of its prompt's text (where the model's placeholder puts them is
    the worker's business), so that the same text with another image is never taken for a cache hit."""
    if not isinstance(payload, dict):
        return ""
    head = _adapter_key(payload)
    if isinstance(payload.get("messages"), list):
        return head + "".join(_message_text(m) for m in payload["messages"])
    for key in ("text", "prompt", "input_ids"):
        value = payload.get(key)
        if value is not None:
            images = payload.get("image_data")
            if isinstance(value, list) and value and not all(isinstance(i, int) for i in value):  # a batch
                per_prompt = images if isinstance(images, list) and len(images) == len(value) else [None] * len(value)
                return head + "\n".join(image_key(i) + _flatten(v) for v, i in zip(value, per_prompt, strict=True))
            return head + image_key(images) + _flatten(value)
    return head


def image_key(images: Any) -> str:
    """Each image source (a data URL, base64, a URL, a path) as a short digest, in a form no prompt text holds
    ("" for none). Equal sources give equal keys; one image sent once as base64 and once as a data URL gives two
    (the router does not decode images): a missed routing hint, never a false one."""
    if images is None:
        return ""
    sources = images if isinstance(images, list) else [images]
    out = []
    for src in sources:
        if src is None:
            continue
        if not isinstance(src, str):  # no image source a worker takes (it answers the 400): no routing hint,
            out.append("\x01?\x01")  # and nothing that walks a nested value
            continue
        raw = src.encode("utf-8", "surrogatepass")
        out.append(f"\x01{hashlib.blake2b(raw, digest_size=10).hexdigest()}\x01")
    return "".join(out)


def _adapter_key(payload: dict) -> str:
    """`lora_name` or its alias `lora_path` (native and extra-body) or `model` (OpenAI: it may name an adapter),
    in a form no prompt text starts with; "" for none."""
    names = payload.get("lora_name")
    if names is None:
        names = payload.get("lora_path")
    if names is None:
        names = payload.get("model")
    if isinstance(names, list):
        names = ",".join(str(n) for n in names)
    return f"\x00{names}\x00" if isinstance(names, str) else ""


def _message_text(message: Any) -> str:
    if not isinstance(message, dict):
        return ""
    content = message.get("content")
    if isinstance(content, list):  # content parts: their text in order, each image as its digest
        content = "".join(_part_text(p) for p in content if isinstance(p, dict))
    return f"<{message.get('role', '')}>{content if isinstance(content, str) else ''}\n"


def _part_text(part: dict) -> str:
    if part.get("type") == "image_url":
        spec = part.get("image_url")
        return image_key(spec.get("url") if isinstance(spec, dict) else spec)
    return part["text"] if isinstance(part.get("text"), str) else ""


def _flatten(x: Any, depth: int = 0) -> str:
    """A prompt's routing text: a string, token ids, or lists of them (two levels at most; deeper nesting is
    no prompt, and the worker refuses it, so it adds nothing here and never recurses further)."""
    if isinstance(x, str):
        return x
    if isinstance(x, list) and all(isinstance(i, int) for i in x):
        return " ".join(map(str, x))  # token ids: a common id prefix is a common text prefix (nearly)
    if isinstance(x, list) and depth < 2:
        return "\n".join(_flatten(i, depth + 1) for i in x)
    return ""


class Forwarder:
    def __init__(self, pool: WorkerPool, client: httpx.AsyncClient, metrics: RouterMetrics):
        self.pool = pool
        self.client = client
        self.metrics = metrics

    async def open(
        self,
        policy: Policy,
        method: str,
        path: str,
        body: bytes,
        headers: dict[str, str],
        text: str,
        route: str,
    ) -> Upstream:
        """Send to the worker the policy picks, then to the next untried one while attempts fail before
        their first byte. Raises Unserved when none is left. The worker's in_flight count includes the
        request from here until `release`."""
        tried: set[str] = set()
        failures: list[str] = []
        while candidates := self.pool.candidates(exclude=tried):
            decision = policy.choose(text, candidates)
            worker = self.pool.workers[decision.url]
            tried.add(worker.url)
            request = self.client.build_request(method, worker.url + path, content=body, headers=headers)
            try:
                up = await self._attempt(worker, request)
            except _AttemptFailed as e:
                failures.append(str(e))
                self.metrics.failed_attempts.inc(worker=worker.url)
                if e.worker_down:  # the health check brings it back if it recovers
                    self.pool.mark_down(worker, str(e))
                continue
            self.metrics.requests.inc(worker=worker.url, route=route)
            self.metrics.prompt_chars.inc(len(text), worker=worker.url)
            self.metrics.matched_chars.inc(decision.matched, worker=worker.url)
            return up
        self.metrics.unserved.inc()
        raise Unserved(failures)

    async def _attempt(self, worker: Worker, request: httpx.Request) -> Upstream:
        """One try on one worker, up to its first byte (the whole body when it is not an event stream).
        Raises _AttemptFailed for what another worker may do better: no connection, a 5xx, an empty stream."""
        worker.in_flight += 1
        response = None
        try:
            response = await self.client.send(request, stream=True)
            if response.status_code >= 500:
                detail = (await response.aread())[:300].decode(errors="replace")
                raise _AttemptFailed(f"{worker.url} answered {response.status_code}: {detail}")
            streamed = _is_event_stream(response)
            chunks = response.aiter_raw()
            first = await anext(chunks, b"") if streamed else await response.aread()
            if streamed and not first:
                raise _AttemptFailed(f"{worker.url} ended its stream before the first byte")
            return Upstream(worker, response, first, chunks, streamed)
        except BaseException as e:  # failed or cancelled (the client left): the attempt holds nothing
            worker.in_flight -= 1
            if response is not None:
                await response.aclose()
            if isinstance(e, httpx.TransportError):
                raise _AttemptFailed(f"{worker.url}: {type(e).__name__}: {e or 'connection failed'}", True) from e
            raise

    async def release(self, up: Upstream) -> None:
        up.worker.in_flight -= 1
        await up.response.aclose()

    def respond(self, up: Upstream) -> Response:
        """The worker's answer as the router's response: an event stream relayed chunk by chunk (its
        cleanup releases the upstream), anything else whole (the caller releases the upstream)."""
        headers = response_headers(up.response)
        if up.streamed:
            return RelayStream(self._relay(up), up.response.status_code, headers, lambda: self.release(up))
        return Response(up.first, status_code=up.response.status_code, headers=headers)

    async def _relay(self, up: Upstream) -> AsyncIterator[bytes]:
        yield up.first
        try:
            async for chunk in up.chunks:
                yield chunk
        except httpx.TransportError as e:  # the worker died mid-stream: say so, in the stream
            self.metrics.broken_streams.inc(worker=up.worker.url)
            body = error_body(502, f"worker {up.worker.url} failed mid-stream: {type(e).__name__}", None, "worker_lost")
            yield b"data: " + orjson.dumps(body) + b"\n\ndata: [DONE]\n\n"


class _AttemptFailed(Exception):
    def __init__(self, message: str, worker_down: bool = False):
        super().__init__(message)
        self.worker_down = worker_down  # no connection (or it broke): out of the rotation at once


def _is_event_stream(response: httpx.Response) -> bool:
    return response.headers.get("content-type", "").startswith("text/event-stream")


class RelayStream(StreamingResponse):
    """A relayed event stream. However the response ends (finished, client gone, cancelled) the body
    generator is closed and `cleanup` runs, which closes the upstream connection: the worker sees the
    disconnect and aborts the request."""

    def __init__(
        self,
        content: AsyncIterator[bytes],
        status_code: int,
        headers: dict[str, str],
        cleanup: Callable[[], Awaitable[None]],
    ):
        super().__init__(content, status_code=status_code, headers=headers)
        self.cleanup = cleanup

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.body_iterator.aclose()  # type: ignore[attr-defined]
            await self.cleanup()


async def until_disconnect(request: Request, work: Awaitable[Any]) -> tuple[bool, Any]:
    """Run `work` unless the client disconnects first (then cancel it): (True, result) or (False, None).
    The request body must have been read already."""
    task = asyncio.ensure_future(work)

    async def watch() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    watcher = asyncio.ensure_future(watch())
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
        await asyncio.gather(task, watcher, return_exceptions=True)
    if task.cancelled():
        return False, None
    return True, task.result()
