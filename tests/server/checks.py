"""Checks the server tests share: the server is idle with its KV invariant holding, and still serves."""

from __future__ import annotations

import time

import httpx


def wait_idle(http: httpx.Client, tries: int = 240) -> dict:
    """/get_server_info once nothing runs (aborts and finishes take a few scheduler steps to land)."""
    for _ in range(tries):
        info = http.get("/get_server_info").json()
        if info["num_running"] == 0 and info["num_waiting"] == 0 and info["http"]["active_requests"] == 0:
            return info
        time.sleep(0.25)
    raise AssertionError(f"the server is still busy: {info}")


def assert_still_serves(http: httpx.Client) -> None:
    """A small generation works, and once idle, no KV slot is lost or still locked."""
    r = http.post("/v1/completions", json={"prompt": "One, two,", "max_tokens": 2, "temperature": 0})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] >= 1
    info = wait_idle(http)
    cache = info["cache"]
    assert info["invariant_ok"] is True, info
    assert cache["free"] + cache["evictable"] + cache["protected"] == cache["total"], cache
    assert cache["protected"] == 0, cache
