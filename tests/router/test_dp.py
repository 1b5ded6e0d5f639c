"""`radixgen serve --dp-size N`: the worker command lines, and one real start with 2 workers."""

from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time

import httpx
import pytest
from server_proc import API_KEY, children, free_port

from radixgen.launch.dp import flags_of, worker_commands, worker_threads
from radixgen.runtime.config import RuntimeConfig
from radixgen.runtime.server.launch import ServerConfig, add_server_args, server_args_from


def _parse(argv: list[str]):
    parser = argparse.ArgumentParser()
    add_server_args(parser)
    return server_args_from(parser.parse_args(argv))


def test_worker_threads():
    assert worker_threads({"num_threads": 8}, 2) == 4
    assert worker_threads({"num_threads": 3}, 2) == 1
    assert worker_threads({"num_threads": 1}, 4) == 1  # never 0 (which would mean "all cores")
    assert worker_threads({}, 2) == max(1, (os.cpu_count() or 1) // 2)
    assert worker_threads({"num_threads": 8, "tp_size": 2}, 2) == 2  # per rank: 2 workers x 2 ranks


def test_worker_commands_round_trip_through_the_server_parser():
    argv = ["--dp-size", "3", "--host", "0.0.0.0", "--port", "31000", "--api-key", "k1", "--api-key", "k2",
            "--max-total-tokens", "4000", "--num-threads", "6", "--disable-radix-cache", "--schedule-policy", "fcfs"]
    args = _parse(argv)
    commands = worker_commands(args)
    assert len(commands) == 3
    for i, cmd in enumerate(commands):
        assert cmd[:3] == [sys.executable, "-m", "radixgen.serve"]
        worker = _parse(cmd[3:])
        assert worker.server.port == 31001 + i and worker.server.host == "127.0.0.1"  # loopback only
        assert worker.server.dp_size == 1
        assert worker.api_keys == ("k1", "k2")
        assert worker.engine == {**args.engine, "num_threads": 2}
    # and the inverse helper alone: only what differs from the defaults
    assert flags_of(RuntimeConfig, {"num_threads": 0, "max_total_tokens": 7}) == ["--max-total-tokens", "7"]
    assert flags_of(ServerConfig, {"api_keys": ("a", "b")}) == ["--api-key", "a", "--api-key", "b"]


@pytest.mark.slow
def test_serve_dp_size_2_starts_workers_and_router_and_stops_them():
    port = free_port()
    while any(_in_use(port + i) for i in (1, 2)):
        port = free_port()
    fd, log_path = tempfile.mkstemp(prefix="radixgen-dp-", suffix=".log")
    cmd = [sys.executable, "-m", "radixgen.serve", "--dp-size", "2", "--port", str(port), "--num-threads", "2",
           "--dtype", "auto", "--log-level", "info", "--api-key", API_KEY]
    proc = subprocess.Popen(cmd, stdout=fd, stderr=subprocess.STDOUT)
    os.close(fd)
    url = f"http://127.0.0.1:{port}"
    headers = {"Authorization": f"Bearer {API_KEY}"}
    try:
        deadline = time.monotonic() + 900  # two model loads on a busy machine
        while True:
            assert proc.poll() is None, open(log_path).read()[-4000:]
            assert time.monotonic() < deadline, f"{children(proc.pid)}\n{open(log_path).read()[-4000:]}"
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        workers = [p for p in children(proc.pid) if "radixgen.serve" in _cmdline(p)]
        assert len(workers) == 2
        info = httpx.get(url + "/get_server_info", headers=headers, timeout=60).json()
        assert sorted(w["url"] for w in info["workers"]) == [f"http://127.0.0.1:{port + i}" for i in (1, 2)]
        for w in info["workers"]:
            assert w["healthy"] and w["server_info"]["server_args"]["engine"]["num_threads"] == 1
        r = httpx.post(url + "/v1/completions", json={"prompt": "Hello", "max_tokens": 3}, headers=headers, timeout=120)
        assert r.status_code == 200 and r.json()["choices"][0]["text"]
        assert httpx.post(url + "/v1/completions", json={"prompt": "Hello"}, timeout=60).status_code == 401
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            code = proc.wait(90)
        except subprocess.TimeoutExpired:
            proc.kill()
            code = proc.wait()
    assert code == 0, open(log_path).read()[-4000:]
    for pid in workers:  # the workers went with it
        assert not os.path.exists(f"/proc/{pid}") or _zombie(pid)


def _in_use(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def _zombie(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True
