"""Start and stop a real `python -m radixgen.serve` subprocess on loopback (used by the server tests)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from typing import NamedTuple

import httpx

API_KEY = "test-key-123"
APIS_KEYS = ("apis-key-one", "apis-key-two")  # the Anthropic / Ollama / KServe adapters' server (conftest.py)
START_TIMEOUT_S = 300.0


class Server(NamedTuple):
    url: str
    proc: subprocess.Popen
    log_path: str
    model: str  # the served model id
    api_key: str | None

    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def client(self, **kw) -> httpx.Client:
        return httpx.Client(base_url=self.url, headers=self.headers(), timeout=120.0, **kw)

    def log_tail(self, n: int = 4000) -> str:
        with open(self.log_path, errors="replace") as f:
            return f.read()[-n:]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(*extra: str, api_key: str | None = API_KEY) -> Server:
    port = free_port()
    fd, log_path = tempfile.mkstemp(prefix="radixgen-server-", suffix=".log")
    # one scheduler thread: the HTTP process and the test client need the other core. The dtype `auto` picks: bf16
    # where the CPU has fast bf16 (AVX512-BF16) or the C kernels multiply bf16 in float32 (AVX2), else float32
    server_args = f"--host 127.0.0.1 --port {port} --dtype auto --log-level warning --num-threads 1"
    cmd = [sys.executable, "-m", "radixgen.serve", *server_args.split(), *extra]
    if api_key:
        cmd += ["--api-key", api_key]
    proc = subprocess.Popen(cmd, stdout=fd, stderr=subprocess.STDOUT)
    os.close(fd)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with {proc.returncode}:\n{open(log_path).read()[-4000:]}")
        try:
            if httpx.get(f"{url}/health", timeout=2.0).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    else:
        proc.kill()
        raise RuntimeError(f"the server did not become healthy:\n{open(log_path).read()[-4000:]}")
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    model = httpx.get(f"{url}/v1/models", headers=headers, timeout=10).json()["data"][0]["id"]
    return Server(url, proc, log_path, model, api_key)


def stop_server(server: Server, timeout: float = 60.0) -> int:
    """SIGTERM, wait, return the exit code (killing it if it does not exit in time)."""
    if server.proc.poll() is None:
        server.proc.send_signal(signal.SIGTERM)
    try:
        return server.proc.wait(timeout)
    except subprocess.TimeoutExpired:
        server.proc.kill()
        server.proc.wait()
        return -9


def children(pid: int) -> list[int]:
    """Pids whose parent is `pid` (from /proc)."""
    out = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:  # the field after the state: the parent pid
            out.append(int(entry))
    return out


def cmdline(pid: int) -> str:
    with open(f"/proc/{pid}/cmdline", "rb") as f:
        return f.read().replace(b"\0", b" ").decode(errors="replace")
