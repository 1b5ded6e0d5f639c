"""Faults under traffic: a worker killed mid-load loses no request; workers join and leave under load."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time

import httpx
import pytest
from router_proc import metric, start_router, stop_router
from server_proc import API_KEY, children, start_server, stop_server

pytestmark = pytest.mark.slow

HEADERS = {"Authorization": f"Bearer {API_KEY}"}


async def _one(http: httpx.AsyncClient, i: int, stream: bool, max_tokens: int) -> dict:
    body = {"prompt": f"Request {i}: write a list of animals.", "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": stream}
    if not stream:
        r = await http.post("/v1/completions", json=body)
        return {"stream": False, "status": r.status_code, "body": r.json()}
    events = []
    async with http.stream("POST", "/v1/completions", json=body) as r:
        if r.status_code != 200:
            return {"stream": True, "status": r.status_code, "body": json.loads(await r.aread())}
        async for line in r.aiter_lines():
            if line.startswith("data: "):
                data = line[len("data: "):]
                events.append(data if data == "[DONE]" else json.loads(data))
    return {"stream": True, "status": 200, "events": events}


def _check_answered(result: dict) -> str:
    """Every request gets an answer: a result, a 503 with an error body, or a stream that says it broke."""
    if result["status"] == 503:
        assert result["body"]["error"]["code"] in ("no_healthy_worker", "workers_failed"), result
        return "503"
    assert result["status"] == 200, result
    if not result["stream"]:
        assert result["body"]["choices"][0]["finish_reason"] == "length", result
        return "ok"
    events = result["events"]
    assert events and events[-1] == "[DONE]", events
    if any("error" in e for e in events[:-1]):
        assert events[-2]["error"]["code"] == "worker_lost", events
        return "broken"
    assert events[-2]["choices"][0]["finish_reason"] == "length", events
    return "ok"


def _kill_worker(server) -> None:
    """SIGKILL the server and its scheduler process: the whole worker dies at once."""
    kids = children(server.proc.pid)
    server.proc.kill()
    server.proc.wait()
    for pid in kids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _in_flight(router_url: str, worker_url: str) -> int:
    workers = httpx.get(router_url + "/list_workers", headers=HEADERS, timeout=30).json()["workers"]
    return next((w["in_flight"] for w in workers if w["url"] == worker_url), 0)


def test_killing_a_worker_mid_load_loses_nothing(workers):
    victim = start_server()
    router = start_router([workers[0].url, victim.url], "--policy", "round_robin")
    try:

        async def load():
            async with httpx.AsyncClient(base_url=router.url, headers=HEADERS, timeout=300) as http:
                tasks = [asyncio.ensure_future(_one(http, i, stream=i % 2 == 0, max_tokens=48)) for i in range(12)]
                deadline = time.monotonic() + 120
                while _in_flight(router.url, victim.url) < 2 and time.monotonic() < deadline:
                    await asyncio.sleep(0.1)
                assert _in_flight(router.url, victim.url) >= 2, "the victim never got work"
                _kill_worker(victim)
                late = [asyncio.ensure_future(_one(http, 100 + i, stream=i % 2 == 0, max_tokens=4)) for i in range(6)]
                return await asyncio.gather(*tasks, *late)

        results = asyncio.run(load())
        outcomes = [_check_answered(r) for r in results]
        assert len(outcomes) == 18
        # worker 0 stayed up: what failed before its first byte was retried there, so nothing got a 503
        assert "503" not in outcomes, outcomes
        assert all(o == "ok" for r, o in zip(results, outcomes, strict=True) if not r["stream"]), outcomes
        state = httpx.get(router.url + "/list_workers", headers=HEADERS).json()["workers"]
        assert {w["url"]: w["healthy"] for w in state} == {workers[0].url: True, victim.url: False}
        assert all(w["in_flight"] == 0 for w in state)
        text = httpx.get(router.url + "/metrics", headers=HEADERS).text
        hit = metric(text, f'radixgen_router_failed_attempts_total{{worker="{victim.url}"}}') + metric(
            text, f'radixgen_router_broken_streams_total{{worker="{victim.url}"}}'
        )
        assert hit >= 1  # the kill did catch requests on their way (retried) or mid-stream (reported)
        with httpx.Client(base_url=router.url, headers=HEADERS, timeout=120) as http:
            r = http.post("/v1/completions", json={"prompt": "after", "max_tokens": 2})
            assert r.status_code == 200
    finally:
        stop_router(router)
        if victim.proc.poll() is None:
            stop_server(victim)


def _requests_served(worker) -> int:
    with worker.client() as c:
        return c.get("/get_server_info").json()["stats"]["num_requests"]


def test_workers_join_and_leave_under_traffic(workers):
    w0, w1 = workers
    router = start_router([w0.url])
    try:
        served_before = [_requests_served(w) for w in workers]

        async def traffic():
            async with httpx.AsyncClient(base_url=router.url, headers=HEADERS, timeout=300) as http:
                results: list[dict] = []

                async def client(k: int, n: int):
                    for j in range(n):
                        results.append(await _one(http, 1000 * k + j, stream=j % 2 == 1, max_tokens=6))

                clients = [asyncio.ensure_future(client(k, 8)) for k in range(4)]
                while len(results) < 6:
                    await asyncio.sleep(0.05)
                added = (await http.post("/add_worker", params={"url": w1.url})).json()
                assert added["healthy"] is True
                while len(results) < 18:
                    await asyncio.sleep(0.05)
                removed = await http.post("/remove_worker", params={"url": w0.url})
                assert removed.status_code == 200 and removed.json()["removed"] is True
                await asyncio.gather(*clients)
                return results

        results = asyncio.run(traffic())
        assert len(results) == 32
        assert all(_check_answered(r) == "ok" for r in results)
        served = [_requests_served(w) - b for w, b in zip(workers, served_before, strict=True)]
        assert sum(served) == 32 and served[1] > 0, served  # the new worker took a share
        # w0 left the rotation: new requests all go to w1
        with httpx.Client(base_url=router.url, headers=HEADERS, timeout=120) as http:
            for i in range(3):
                assert http.post("/v1/completions", json={"prompt": f"late {i}", "max_tokens": 2}).status_code == 200
            assert [w["url"] for w in http.get("/list_workers").json()["workers"]] == [w1.url]
        assert _requests_served(w0) - served_before[0] == served[0]
        assert _requests_served(w1) - served_before[1] == served[1] + 3
    finally:
        stop_router(router)


class _FailingWorker:
    """A real HTTP server that passes its health checks but answers every generation with a 503 (a worker
    whose engine is gone), on a thread of this process."""

    def __init__(self) -> None:
        import threading

        import uvicorn
        from fastapi import FastAPI
        from fastapi.responses import JSONResponse

        app = FastAPI()
        self.hits = 0

        @app.get("/health")
        async def health():
            return {"status": "ok"}

        @app.post("/v1/completions")
        async def completions():
            self.hits += 1
            return JSONResponse({"error": {"message": "engine gone", "code": "engine_unavailable"}}, 503)

        from server_proc import free_port

        self.url = f"http://127.0.0.1:{free_port()}"
        port = int(self.url.rsplit(":", 1)[1])
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        while not self.server.started:
            time.sleep(0.05)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(10)


def test_5xx_before_the_first_byte_is_retried_elsewhere(workers):
    failing = _FailingWorker()
    router = start_router([failing.url, workers[0].url], "--policy", "round_robin")
    try:
        with httpx.Client(base_url=router.url, headers=HEADERS, timeout=120) as http:
            for i in range(4):
                body = {"prompt": f"retry {i}", "max_tokens": 2, "stream": i % 2 == 1}
                r = http.post("/v1/completions", json=body)
                assert r.status_code == 200, r.text
            assert failing.hits >= 2  # round-robin sent it half of the first attempts
            text = http.get("/metrics").text
            assert metric(text, f'radixgen_router_failed_attempts_total{{worker="{failing.url}"}}') == failing.hits
            # a 5xx is not a dead worker: it stays in the rotation (its health check passes)
            state = {w["url"]: w["healthy"] for w in http.get("/list_workers").json()["workers"]}
            assert state[failing.url] is True
            # when every worker fails: a 503 that names what each attempt got
            http.post("/remove_worker", params={"url": workers[0].url}).raise_for_status()
            r = http.post("/v1/completions", json={"prompt": "nobody", "max_tokens": 2})
            assert r.status_code == 503
            error = r.json()["error"]
            assert error["code"] == "workers_failed" and "engine gone" in error["message"], error
    finally:
        stop_router(router)
        failing.stop()
