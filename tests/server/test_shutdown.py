"""Lifecycle: /health when the scheduler dies, and SIGTERM with a request in flight.

The last test here ends the session's shared server, so this module runs after the other server tests."""

from __future__ import annotations

import json
import os
import signal
import threading

import httpx
import pytest
from server_proc import children, cmdline, start_server, stop_server

pytestmark = pytest.mark.slow


def test_scheduler_gone_gives_503_and_still_exits_0():
    srv = start_server("--max-total-tokens", "4096", api_key=None)
    try:
        procs = {p: cmdline(p) for p in children(srv.proc.pid)}
        (scheduler,) = [p for p, cmd in procs.items() if "resource_tracker" not in cmd]
        os.kill(scheduler, signal.SIGKILL)
        deadline = httpx.Timeout(10.0)
        for _ in range(100):
            r = httpx.get(srv.url + "/health", timeout=deadline)
            if r.status_code == 503:
                break
            threading.Event().wait(0.1)
        assert r.status_code == 503
        assert r.json()["error"]["code"] == "scheduler_gone"
        r = httpx.post(srv.url + "/v1/completions", json={"prompt": "x", "max_tokens": 2}, timeout=deadline)
        assert r.status_code == 503 and r.json()["error"]["message"]
        for body in (r.text, httpx.get(srv.url + "/health", timeout=deadline).text):  # named, not traced
            assert "Traceback" not in body and ".py" not in body and "/radixgen/" not in body, body
        metrics = httpx.get(srv.url + "/metrics", timeout=deadline)  # the HTTP-side figures remain
        assert metrics.status_code == 200 and 'radixgen_request_errors_total{status="503"}' in metrics.text
    finally:
        code = stop_server(srv)
    assert code == 0, srv.log_tail()


def test_sigterm_finishes_the_request_in_flight_and_exits_0(server):
    """Ends the shared server: stop accepting, let the running stream finish, shut down, exit 0."""
    body = {
        "model": server.model,
        "prompt": "Count: 1, 2,",
        "max_tokens": 8,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }
    events: list = []
    first = threading.Event()

    def consume() -> None:
        with httpx.stream(
            "POST", server.url + "/v1/completions", json=body, headers=server.headers(), timeout=120
        ) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    events.append(line[6:])
                    first.set()
        first.set()

    t = threading.Thread(target=consume)
    t.start()
    assert first.wait(120)
    server.proc.send_signal(signal.SIGTERM)
    t.join(120)
    assert server.proc.wait(60) == 0, server.log_tail()
    assert events[-1] == "[DONE]"
    finishes = [json.loads(e)["choices"][0]["finish_reason"] for e in events[:-1]]
    assert finishes[-1] == "length" and finishes.count("length") == 1
    with pytest.raises(httpx.ConnectError):
        httpx.get(server.url + "/health", timeout=5)
