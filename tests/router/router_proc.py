"""Start and stop a real `python -m radixgen.router` subprocess on loopback."""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import time
from typing import NamedTuple

import httpx
from server_proc import free_port, stop_server

START_TIMEOUT_S = 180.0  # the machine may be busy


class Router(NamedTuple):
    url: str
    proc: subprocess.Popen
    log_path: str
    api_key: str | None

    def client(self, api_key: str | None = None, **kw) -> httpx.Client:
        key = api_key or self.api_key
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        return httpx.Client(base_url=self.url, headers=headers, **{"timeout": 120.0, **kw})

    def log_tail(self, n: int = 4000) -> str:
        with open(self.log_path, errors="replace") as f:
            return f.read()[-n:]


def start_router(worker_urls: list[str], *extra: str, api_key: str | None = None, wait_healthy: bool = True) -> Router:
    port = free_port()
    fd, log_path = tempfile.mkstemp(prefix="radixgen-router-", suffix=".log")
    cmd = [sys.executable, "-m", "radixgen.router", "--host", "127.0.0.1", "--port", str(port),
           "--health-check-interval", "0.5", "--log-level", "warning", *extra]
    if worker_urls:
        cmd += ["--worker-urls", *worker_urls]
    if api_key:
        cmd += ["--api-key", api_key]
    proc = subprocess.Popen(cmd, stdout=fd, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the router exited with {proc.returncode}:\n{open(log_path).read()[-4000:]}")
        try:
            code = httpx.get(f"{url}/health", timeout=2.0).status_code
            if code == 200 or (code == 503 and not wait_healthy):
                return Router(url, proc, log_path, api_key)
        except httpx.HTTPError:
            pass
        time.sleep(0.25)
    proc.kill()
    raise RuntimeError(f"the router did not become healthy:\n{open(log_path).read()[-4000:]}")


def stop_router(router: Router) -> int:
    return stop_server(router, timeout=30.0)  # type: ignore[arg-type] - the same SIGTERM / wait / kill


def sse_events(lines) -> list:
    """The JSON events of an SSE body, and "[DONE]" as itself."""
    out = []
    for line in lines:
        if line.startswith("data: "):
            data = line[len("data: "):]
            out.append(data if data == "[DONE]" else json.loads(data))
    return out


def metric(text: str, name: str) -> float:
    """One sample of a Prometheus text body (0 when absent)."""
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.rsplit(" ", 1)[1])
    return 0.0
