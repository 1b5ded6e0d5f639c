"""Engine requests on behalf of HTTP handlers: rids, latency metrics, and abort on disconnect or shutdown."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Coroutine
from contextlib import aclosing
from typing import Any

from starlette.requests import Request

from radixgen.common.http_errors import APIError
from radixgen.runtime.engine.request_state import RequestError
from radixgen.runtime.server.metrics import ServerMetrics
from radixgen.runtime.server.middleware import KEY_NAMESPACE, scoped_cache_salt

SHUTDOWN_CODE = "server_shutting_down"


def new_rid(prefix: str = "") -> str:
    return f"{prefix}{uuid.uuid4().hex}"


class ClientGone(Exception):
    """The HTTP client disconnected before its (non-streamed) response was ready."""


class KeyScopedEngine:
    """The Engine as the HTTP handlers see it when API keys are isolated (--cache-isolation per-key):
    every generation request runs in its key's cache namespace (combined with its own cache_salt), so
    one key's prompts never share cached prefixes with another's. Everything else is the Engine's."""

    def __init__(self, engine: Any):
        self._engine = engine

    def __getattr__(self, name: str) -> Any:
        return getattr(self._engine, name)

    async def async_generate(self, *args: Any, cache_salt: str | None = None, **kwargs: Any) -> Any:
        return await self._engine.async_generate(*args, cache_salt=scoped_cache_salt(cache_salt), **kwargs)

    async def async_embed(self, *args: Any, cache_salt: str | None = None, **kwargs: Any) -> Any:
        return await self._engine.async_embed(*args, cache_salt=scoped_cache_salt(cache_salt), **kwargs)

    async def async_score(self, *args: Any, cache_salt: str | None = None, **kwargs: Any) -> Any:
        return await self._engine.async_score(*args, cache_salt=scoped_cache_salt(cache_salt), **kwargs)


class Dispatcher:
    """Every engine call of the server goes through here, so that each running request has a known rid:
    /abort_request, a client disconnect and a shutdown can all abort it, and its latencies are recorded."""

    def __init__(self, engine: Any, metrics: ServerMetrics):
        self.engine = engine
        self.metrics = metrics
        self.active: set[str] = set()  # rids submitted and not finished
        self.owners: dict[str, str | None] = {}  # an active rid -> the cache namespace of the key that sent it
        self.groups: dict[str, list[str]] = {}  # an API request id -> its engine rids (n > 1, batches)
        self.cut_reason: str | None = None  # set at shutdown, when what still runs is cut off

    def refuse_taken(self, rids: list[str]) -> None:
        """400 for a rid (or request group id) that a running request already uses. Refused here, before
        anything is sent, so that the refusal cannot touch the running request."""
        taken = [r for r in rids if r in self.active or r in self.groups]
        if taken:
            raise APIError(400, f"request id {taken[0]!r} is already in use by a running request", "rid",
                           "duplicate_rid")

    def check_alive(self) -> None:
        """503 at once when the scheduler is gone (a message to a dead scheduler may never be taken)."""
        if self.cut_reason is not None:
            raise APIError(503, self.cut_reason, None, SHUTDOWN_CODE)
        if not self.engine.is_alive:
            raise APIError(503, "the scheduler process is not running", None, "scheduler_gone")

    def cut_off(self, reason: str) -> int:
        """At shutdown, past the grace period: abort every running request; each ends with an error
        (`reason`, 503) instead of a result, so that its stream gets a final error event."""
        self.cut_reason = reason
        return self.abort_all()

    def _check_cut(self, meta: dict) -> None:
        if self.cut_reason is not None and (meta.get("finish_reason") or {}).get("type") == "abort":
            raise APIError(503, self.cut_reason, None, SHUTDOWN_CODE)

    # ------------------------------------------------------------ abort

    def abort(self, rid: str) -> bool:
        """Abort a rid or a group of them; False when nothing by that id is running."""
        rids = [r for r in self.groups.get(rid, [rid]) if r in self.active]
        for r in rids:
            self.engine.abort(r)
        return bool(rids)

    def abort_all(self) -> int:
        rids = list(self.active)
        for r in rids:
            self.engine.abort(r)
        return len(rids)

    def abort_for_caller(self, rid: str | None, every: bool) -> bool:
        """/abort_request: what the calling key may abort, its own requests only when keys are isolated (another
        key's rid is answered as one not running)."""
        mine = KEY_NAMESPACE.get()
        if mine is None:
            return self.abort_all() > 0 if every else self.abort(rid)
        rids = list(self.active) if every else [r for r in self.groups.get(rid, [rid]) if r in self.active]
        rids = [r for r in rids if self.owners.get(r) == mine]
        for r in rids:
            self.engine.abort(r)
        return bool(rids)

    def _enter(self, rids: list[str]) -> None:
        self.active.update(rids)
        self.owners.update(dict.fromkeys(rids, KEY_NAMESPACE.get()))

    def _leave(self, rids: list[str]) -> None:
        self.active.difference_update(rids)
        for r in rids:
            self.owners.pop(r, None)

    def open_group(self, group: str, rids: list[str]) -> None:
        if len(rids) > 1 or rids[0] != group:
            self.groups[group] = rids

    def end_group(self, group: str) -> None:
        """The API request is over (answered, failed or abandoned): abort what of it still runs."""
        self.abort(group)
        self.groups.pop(group, None)

    # ------------------------------------------------------------ streams

    async def open(
        self, jobs: list[tuple[str, dict[str, Any]]], arrived: float, prime: bool = False
    ) -> list[AsyncIterator[dict]]:
        """(rid, engine kwargs) requests as streams. Bad parameters raise here (ValueError). With `prime`,
        the first chunk of each is awaited too, so that what the scheduler rejects (a grammar that does
        not compile) also raises here, before a streamed response has sent its status line."""
        self.check_alive()
        self.refuse_taken([rid for rid, _ in jobs])
        opened: list[str] = []
        streams = []
        try:
            for rid, kwargs in jobs:
                it = await self.engine.async_generate(stream=True, rid=rid, **kwargs)
                opened.append(rid)
                self._enter([rid])
                streams.append(self._follow(rid, it, arrived))
            if prime:
                streams = await _primed(streams)
        except BaseException:
            for rid in opened:
                if rid in self.active:
                    self._leave([rid])
                    self.engine.abort(rid)
            raise
        return streams

    async def _follow(self, rid: str, it: AsyncIterator[dict], arrived: float) -> AsyncIterator[dict]:
        """The engine's chunks for one request. A consumer that stops early (a disconnect, a cancelled
        task, a closed generator) aborts the request, which frees its KV slots."""
        finished = False
        last = None
        seen_tokens = 0
        try:
            async for chunk in it:
                meta = chunk["meta_info"]
                now = time.perf_counter()
                tokens = meta.get("completion_tokens", 0)
                if tokens > seen_tokens:
                    if last is None:
                        self.metrics.ttft.observe(now - arrived)
                    else:  # a chunk may carry several tokens; each gets its share of the gap
                        gap = (now - last) / (tokens - seen_tokens)
                        for _ in range(tokens - seen_tokens):
                            self.metrics.itl.observe(gap)
                    last, seen_tokens = now, tokens
                if meta.get("finish_reason") is not None:
                    finished = True
                    self._check_cut(meta)
                    self.metrics.observe_finished(meta)
                    self.metrics.e2e.observe(now - arrived)
                yield chunk
        finally:
            self._leave([rid])
            if not finished:
                self.engine.abort(rid)
                self.metrics.finished.inc(reason="client_abort")

    async def call(self, rids: list[str], arrived: float, coro: Coroutine[Any, Any, Any]) -> Any:
        """Await a non-streamed engine call for `rids`, aborting them if it is cancelled or fails."""
        try:
            self.check_alive()
            self.refuse_taken(rids)
        except APIError:
            coro.close()  # type: ignore[attr-defined] - never started: nothing to abort
            raise
        self._enter(rids)
        done = False
        try:
            result = await coro
            done = True
        except RequestError:  # refused before anything was sent: there is nothing of ours to abort
            done = True
            raise
        finally:
            self._leave(rids)
            if not done:
                for r in rids:
                    self.engine.abort(r)
                self.metrics.finished.inc(len(rids), reason="client_abort")
        for out in result if isinstance(result, list) else [result]:
            self._check_cut(out["meta_info"])
            self.metrics.observe_finished(out["meta_info"])
        self.metrics.e2e.observe(time.perf_counter() - arrived)
        return result


async def _primed(streams: list[AsyncIterator[dict]]) -> list[AsyncIterator[dict]]:
    firsts = await asyncio.gather(*(anext(s) for s in streams), return_exceptions=True)
    failed = [e for e in firsts if isinstance(e, BaseException)]
    if failed:
        for s in streams:
            await s.aclose()
        if isinstance(failed[0], StopAsyncIteration):
            raise RuntimeError("the engine ended a stream without a result")
        raise failed[0]
    return [_prepend(first, rest) for first, rest in zip(firsts, streams, strict=True)]


async def _prepend(first: dict, rest: AsyncIterator[dict]) -> AsyncIterator[dict]:
    try:
        yield first
        async for chunk in rest:
            yield chunk
    finally:
        await rest.aclose()  # type: ignore[attr-defined]


async def merge(streams: list[AsyncIterator[dict]]) -> AsyncIterator[tuple[int, dict]]:
    """Chunks of several streams as they come, tagged with the stream's index. Closing this generator
    closes the streams (cancels their readers), which runs each stream's cleanup (its abort)."""
    if len(streams) == 1:
        async with aclosing(streams[0]) as stream:  # type: ignore[type-var]
            async for chunk in stream:
                yield 0, chunk
        return
    queue: asyncio.Queue = asyncio.Queue()  # unbounded: a reader never waits on put, only in its stream
    done = object()

    async def read(i: int, s: AsyncIterator[dict]) -> None:
        try:
            async for chunk in s:
                queue.put_nowait((i, chunk))
        except Exception as e:  # noqa: BLE001 - handed to the consumer
            queue.put_nowait((i, e))
        finally:
            queue.put_nowait((i, done))

    tasks = [asyncio.ensure_future(read(i, s)) for i, s in enumerate(streams)]
    remaining = len(tasks)
    try:
        while remaining:
            i, item = await queue.get()
            if item is done:
                remaining -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield i, item
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def until_disconnect(request: Request, coro: Awaitable[Any]) -> Any:
    """Run `coro`; cancel it (so its cleanup aborts the engine requests) when the client disconnects."""
    work = asyncio.ensure_future(coro)

    async def watch() -> None:
        while True:
            message = await request.receive()
            if message["type"] == "http.disconnect":
                return

    watcher = asyncio.ensure_future(watch())
    try:
        await asyncio.wait({work, watcher}, return_when=asyncio.FIRST_COMPLETED)
    except BaseException:  # this handler was cancelled (e.g. at shutdown): take the work down with it
        work.cancel()
        watcher.cancel()
        await asyncio.gather(work, watcher, return_exceptions=True)
        raise
    watcher.cancel()
    if work.done():
        return work.result()
    work.cancel()
    await asyncio.gather(work, return_exceptions=True)
    raise ClientGone()
