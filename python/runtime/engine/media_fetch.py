"""Remote images (http(s) URLs, --allow-remote-media) fetched on a pool of their own, before a request's images
are decoded on the tokenizer threads: a slow image host then holds up only the requests that name it, never the
tokenizing of other requests (text-only ones keep their latency while fetches hang).

Bounds: each fetch by common.media.fetch's whole-fetch deadline (--media-fetch-timeout-s) and byte limit; a request
runs at most FETCHES_PER_REQUEST of its fetches at a time; the server at most FETCH_WORKERS at once, every one on
a thread of its own (none waits in a queue). A request whose fetch finds them all taken is refused at once with
MediaFetchBusy (HTTP 503, code "media_fetch_busy"), rather than waiting behind hosts that may never answer.
"""

from __future__ import annotations

import asyncio
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from radixgen.common.media import MediaError, fetch, is_url
from radixgen.common.prompt import MediaSegment, Prompt
from radixgen.runtime.config import RuntimeConfig
from radixgen.runtime.engine.request_state import RequestError

FETCH_WORKERS = 16  # fetches in flight on the server, each on its own thread
FETCHES_PER_REQUEST = 4  # of one request's, at a time


class MediaFetchBusy(RuntimeError):
    """Every fetch thread is taken: the request is refused now (503), to be retried later."""

    status = 503
    code = "media_fetch_busy"


class RemoteFetcher:
    def __init__(self, config: RuntimeConfig, workers: int = FETCH_WORKERS,
                 per_request: int = FETCHES_PER_REQUEST) -> None:
        self.config, self.workers, self.per_request = config, workers, per_request
        self._pool = ThreadPoolExecutor(workers, thread_name_prefix="radixgen-media-fetch")
        self._lock = threading.Lock()
        self.in_flight = 0  # fetches submitted and not finished (their threads may outlive a cancelled request)

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    # ------------------------------------------------------------------ what a request names

    async def resolve(self, prompt: Any, image_data: Any) -> tuple[Any, Any]:
        """`prompt` (Prompt(s) with media segments, or text) and `image_data` (a source, or lists of them) with every
        http(s) URL replaced by the bytes fetched from it; both as given when there is none (or remote media is
        not allowed: decoding refuses the URL then, naming the flag)."""
        prompts = prompt if isinstance(prompt, (list, tuple)) else [prompt]
        segments = [s for p in prompts if isinstance(p, Prompt) for s in p.media]
        urls = [s.payload for s in segments if is_url(s.payload)] + _urls(image_data)
        if not urls or not self.config.allow_remote_media:
            return prompt, image_data
        got = await self.fetch_all(urls)
        swap = lambda x: got.get(x, x) if isinstance(x, str) else x  # noqa: E731
        if segments:
            fixed = [Prompt(tuple(MediaSegment(s.kind, swap(s.payload), s.content_hash)
                                  if isinstance(s, MediaSegment) else s for s in p.segments))
                     if isinstance(p, Prompt) else p for p in prompts]
            prompt = fixed if isinstance(prompt, (list, tuple)) else fixed[0]
        if isinstance(image_data, (list, tuple)):
            image_data = [[swap(y) for y in x] if isinstance(x, (list, tuple)) else swap(x) for x in image_data]
        else:
            image_data = swap(image_data)
        return prompt, image_data

    async def resolve_list(self, images: list) -> list:
        """A flat list of image sources, URLs fetched (a chat prompt's images)."""
        return (await self.resolve(None, list(images)))[1]

    # ------------------------------------------------------------------ fetching

    async def fetch_all(self, urls: list[str]) -> dict[str, bytes]:
        """Each distinct URL's bytes, at most `per_request` at a time; RequestError for a fetch that fails,
        MediaFetchBusy when no fetch thread is free."""
        unique = list(dict.fromkeys(urls))
        gate = asyncio.Semaphore(self.per_request)
        loop = asyncio.get_running_loop()
        c = self.config

        async def one(url: str) -> bytes:
            async with gate:
                with self._lock:
                    if self.in_flight >= self.workers:
                        raise MediaFetchBusy(f"the server is fetching {self.in_flight} remote images already, its "
                                             f"limit; retry later, or send the image as a data URL or base64")
                    self.in_flight += 1
                try:
                    future = self._pool.submit(fetch, url, c.max_media_bytes, c.media_fetch_timeout_s)
                except RuntimeError:  # the pool is shut down
                    self._done(None)
                    raise
                future.add_done_callback(self._done)  # the slot frees when the thread does, not when we stop waiting
                try:
                    return await asyncio.wrap_future(future, loop=loop)
                except MediaError as e:
                    raise RequestError(str(e)) from None  # it names the URL

        tasks = [asyncio.ensure_future(one(u)) for u in unique]
        try:
            return dict(zip(unique, await asyncio.gather(*tasks), strict=True))
        finally:
            for t in tasks:
                t.cancel()

    def _done(self, _future: Any) -> None:
        with self._lock:
            self.in_flight -= 1


def _urls(image_data: Any) -> list[str]:
    items = image_data if isinstance(image_data, (list, tuple)) else [image_data]
    flat = [y for x in items for y in (x if isinstance(x, (list, tuple)) else [x])]
    return [x for x in flat if is_url(x)]

