"""A real server with `--tp-size 2` (two rank processes, one thread each), and what happens when a rank fails
under traffic: the group goes down cleanly (the requests in flight end with 503, /health says 503, new
requests get 503 at once, the server still shuts down with exit code 0), whether the rank dies (SIGKILL) or
hangs (SIGSTOP, noticed when a collective passes --dist-timeout)."""

from __future__ import annotations

import os
import signal
import threading
import time

import httpx
import pytest
from server_proc import start_server, stop_server


def rank_pid(client: httpx.Client, rank: int) -> int:
    return client.get("/get_server_info").json()["parallel"]["rank_pids"][str(rank)]


@pytest.fixture(scope="module")
def tp_server():
    server = start_server("--tp-size", "2", "--max-total-tokens", "8192", api_key=None)
    yield server
    assert stop_server(server) == 0, server.log_tail()


def test_both_apis_over_tp2(tp_server):
    with tp_server.client() as c:
        info = c.get("/get_server_info").json()
        assert info["parallel"]["tp_size"] == 2 and set(info["parallel"]["rank_pids"]) == {"0", "1"}
        r = c.post("/generate", json={"text": "The capital of France is",
                                      "sampling_params": {"max_new_tokens": 8, "temperature": 0}})
        assert r.status_code == 200 and r.json()["meta_info"]["completion_tokens"] == 8
        r = c.post("/v1/chat/completions", json={"model": tp_server.model, "max_tokens": 8, "temperature": 0,
                                                 "messages": [{"role": "user", "content": "Say hi"}]})
        assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"]
        assert c.get("/health").status_code == 200


def _traffic(client: httpx.Client, results: list) -> list[threading.Thread]:
    def one(stream: bool) -> None:
        body = {"text": "Tell me a long story about a dragon", "stream": stream,
                "sampling_params": {"max_new_tokens": 2000, "ignore_eos": True}}
        try:
            if stream:
                with client.stream("POST", "/generate", json=body) as r:
                    results.append(("stream", r.status_code, "".join(r.iter_text())))
            else:
                r = client.post("/generate", json=body)
                results.append(("plain", r.status_code, r.text))
        except httpx.HTTPError as e:  # a hang would end here, at the client's timeout
            results.append(("error", None, repr(e)))

    threads = [threading.Thread(target=one, args=(s,)) for s in (False, False, True)]
    for t in threads:
        t.start()
    return threads


@pytest.mark.parametrize("how", ["killed", "hung"])
def test_a_failed_rank_takes_the_group_down_cleanly(how):
    extra = ("--dist-timeout", "5") if how == "hung" else ()
    server = start_server("--tp-size", "2", "--max-total-tokens", "8192", *extra, api_key=None)
    pid = None
    try:
        with server.client() as c:  # its 120 s timeout bounds a hang
            pid = rank_pid(c, 1)
            results: list = []
            threads = _traffic(c, results)
            for _ in range(600):  # until all three are decoding
                if c.get("/get_server_info").json()["num_running"] == 3:
                    break
                time.sleep(0.2)
            os.kill(pid, signal.SIGKILL if how == "killed" else signal.SIGSTOP)
            for t in threads:
                t.join(180)
            assert len(results) == 3, results
            for kind, status, text in results:
                if kind == "plain":
                    assert status == 503 and '"error"' in text, (status, text)
                else:  # the stream had started: its last event is the error
                    assert kind == "stream" and status == 200 and '"error"' in text, (kind, status, text)
            health = c.get("/health")
            assert health.status_code == 503 and "scheduler" in health.json()["error"]["message"]
            r = c.post("/generate", json={"text": "Hi", "sampling_params": {"max_new_tokens": 2}})
            assert r.status_code == 503
    finally:
        if pid is not None and how == "hung":
            try:
                os.kill(pid, signal.SIGKILL)  # if the group's stop has not reached it yet
            except ProcessLookupError:
                pass
        assert stop_server(server) == 0, server.log_tail()
