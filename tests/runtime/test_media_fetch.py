"""The Engine's pool of image fetches (engine/media_fetch.py) against a local threaded HTTP server that holds every
answer until the test releases it: a request runs at most `per_request` of its fetches at once, the pool at most
`workers` in all (a request finding none free is refused at once with MediaFetchBusy), and the slots come back when
the fetches end."""

from __future__ import annotations

import asyncio
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from radixgen.common.prompt import MediaSegment, Prompt, TextSegment
from radixgen.runtime.config import RuntimeConfig
from radixgen.runtime.engine.media_fetch import MediaFetchBusy, RemoteFetcher
from radixgen.runtime.engine.request_state import RequestError


class Held(BaseHTTPRequestHandler):
    release = threading.Event()
    lock = threading.Lock()
    now = peak = served = 0

    def log_message(self, *args) -> None:
        pass

    def do_GET(self) -> None:  # noqa: N802
        cls = type(self)
        with cls.lock:
            cls.now += 1
            cls.peak = max(cls.peak, cls.now)
        cls.release.wait(30)  # bounded: the test releases it
        with cls.lock:
            cls.now -= 1
            cls.served += 1
        body = self.path.encode()
        self.send_response(404 if self.path == "/missing" else 200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


@pytest.fixture
def host():
    Held.release.clear()
    Held.now = Held.peak = Held.served = 0
    server = ThreadingHTTPServer(("127.0.0.1", 0), Held)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    Held.release.set()
    server.shutdown()
    server.server_close()


def _wait_for(n: int) -> None:
    for _ in range(300):
        with Held.lock:
            if Held.now >= n:
                return
        time.sleep(0.02)
    raise AssertionError(f"{Held.now} fetches arrived, expected {n}")


def test_a_request_runs_at_most_its_share_and_the_pool_refuses_when_full(host):
    fetcher = RemoteFetcher(RuntimeConfig(allow_remote_media=True), workers=5, per_request=3)

    async def scenario():
        urls = [f"{host}/{i}.png" for i in range(6)]
        prompt = Prompt((TextSegment("look"), *(MediaSegment.image(u) for u in urls[:2])))
        first = asyncio.ensure_future(fetcher.resolve(prompt, urls[2:]))
        await asyncio.to_thread(_wait_for, 3)
        await asyncio.sleep(0.2)  # room for a fourth, which the per-request cap must hold back
        assert Held.now == 3 and fetcher.in_flight == 3
        second = asyncio.ensure_future(fetcher.resolve_list([f"{host}/b{i}.png" for i in range(2)]))
        await asyncio.to_thread(_wait_for, 5)
        with pytest.raises(MediaFetchBusy):  # all 5 threads hang: refused at once, not queued
            await fetcher.resolve_list([f"{host}/c.png"])
        Held.release.set()
        fixed, image_data = await first
        assert [s.payload for s in fixed.media] == [f"/{i}.png".encode() for i in range(2)]
        assert image_data == [f"/{i}.png".encode() for i in range(2, 6)]
        assert await second == [f"/b{i}.png".encode() for i in range(2)]
        with pytest.raises(RequestError, match="answered HTTP 404"):
            await fetcher.resolve_list([f"{host}/missing"])

    try:
        asyncio.run(scenario())
    finally:
        fetcher.shutdown()
    assert Held.peak == 5 and Held.served == 9 and fetcher.in_flight == 0


def test_nothing_is_fetched_when_remote_media_is_off(host):
    fetcher = RemoteFetcher(RuntimeConfig(allow_remote_media=False))
    try:
        prompt, data = asyncio.run(fetcher.resolve("text", [f"{host}/x.png"]))
    finally:
        fetcher.shutdown()
    assert data == [f"{host}/x.png"] and Held.served == 0  # decoding refuses the URL, naming the flag
