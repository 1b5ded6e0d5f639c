"""200 concurrent streaming clients on loopback, a quarter of them hanging up midway."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest

pytestmark = pytest.mark.slow

NUM_CLIENTS = 200
MAX_TOKENS = 8
HANG_UP_AFTER_CHUNKS = 2  # of MAX_TOKENS: "midway"
LOAD_TIMEOUT_S = 300.0
SHARED = "You are a terse assistant. Answer with a short list of words, no more. "


async def _client(http: httpx.AsyncClient, model: str, i: int) -> dict:
    hang_up = i % 4 == 0
    body = {
        "model": model,
        "prompt": SHARED + f"Request {i}: list things that are blue.",
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }
    chunks, text, finish, done = 0, "", None, False
    async with http.stream("POST", "/v1/completions", json=body) as r:
        assert r.status_code == 200, await r.aread()
        async for line in r.aiter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                done = True
                break
            event = json.loads(line[len("data: ") :])
            assert "error" not in event, event
            chunks += 1
            choice = event["choices"][0]
            text += choice["text"]
            if choice["finish_reason"]:
                assert finish is None
                finish = choice["finish_reason"]
            if hang_up and chunks >= HANG_UP_AFTER_CHUNKS:
                return {"hung_up": True}  # leaving the block closes the connection mid-stream
    return {"hung_up": False, "finish": finish, "done": done, "text": text}


async def _health_poller(url: str, stop: asyncio.Event) -> list[int]:
    codes = []
    async with httpx.AsyncClient(base_url=url, timeout=30.0) as http:
        while not stop.is_set():
            codes.append((await http.get("/health")).status_code)
            await asyncio.sleep(0.25)
    return codes


async def _load(server) -> tuple[list[dict], list[int]]:
    limits = httpx.Limits(max_connections=NUM_CLIENTS + 8, max_keepalive_connections=NUM_CLIENTS + 8)
    async with httpx.AsyncClient(
        base_url=server.url, headers=server.headers(), timeout=LOAD_TIMEOUT_S, limits=limits
    ) as http:
        stop = asyncio.Event()
        poller = asyncio.ensure_future(_health_poller(server.url, stop))
        try:
            results = await asyncio.wait_for(
                asyncio.gather(*(_client(http, server.model, i) for i in range(NUM_CLIENTS))), LOAD_TIMEOUT_S
            )
        finally:
            stop.set()
            codes = await poller
    return results, codes


def _wait_idle(http: httpx.Client, timeout: float = 60.0) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        info = http.get("/get_server_info").json()
        if info["num_running"] == 0 and info["num_waiting"] == 0 and info["http"]["active_requests"] == 0:
            return info
        assert time.monotonic() < deadline, f"still busy after {timeout}s: {info}"
        time.sleep(0.25)


def _metric(http: httpx.Client, name: str) -> float:
    for line in http.get("/metrics").text.splitlines():
        if line.startswith(name + " "):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def test_200_concurrent_streams_with_disconnects(server):
    with server.client() as http:
        aborted_before = _metric(http, 'radixgen_requests_finished_total{reason="client_abort"}')
        results, health_codes = asyncio.run(_load(server))

        hung_up = [r for r in results if r["hung_up"]]
        completed = [r for r in results if not r["hung_up"]]
        assert len(hung_up) == NUM_CLIENTS // 4 and len(completed) == NUM_CLIENTS - NUM_CLIENTS // 4
        for r in completed:
            assert r["done"] and r["finish"] == "length" and r["text"]
        assert health_codes and set(health_codes) == {200}

        info = _wait_idle(http)
        cache = info["cache"]
        assert cache["free"] + cache["evictable"] + cache["protected"] == cache["total"], cache
        assert cache["protected"] == 0, cache  # nothing is still locked by a vanished client
        assert info.get("invariant_ok", True)
        # the hang-ups were noticed and aborted in the engine (not left to run to max_tokens)
        aborted = _metric(http, 'radixgen_requests_finished_total{reason="client_abort"}') - aborted_before
        assert aborted >= 1
        assert http.get("/health").status_code == 200
