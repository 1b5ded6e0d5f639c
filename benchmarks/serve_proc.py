"""Server subprocesses for the serving benchmarks: start `radixgen serve` (or the router) on a free loopback
port, wait until /health answers, stop it with SIGTERM. Imported by the bench_* scripts (their folder is on
sys.path when they run)."""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import tempfile
import time

import httpx

START_TIMEOUT_S = 600.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serve_command(port: int, *flags: str) -> list[str]:
    """`python -m radixgen.serve` on 127.0.0.1:port with warnings-only logs, then `flags`."""
    return [sys.executable, "-m", "radixgen.serve", "--host", "127.0.0.1", "--port", str(port),
            "--log-level", "warning", *flags]


def start(cmd: list[str], url: str, name: str) -> tuple[subprocess.Popen, str]:
    """Run `cmd` (its output to a log file) until `url`/health answers 200; (the process, the log's path).
    SystemExit, naming the log, when it exits or does not become healthy in time."""
    log = tempfile.NamedTemporaryFile(prefix=f"bench-{name}-", suffix=".log", delete=False)
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"{name} exited with {proc.returncode}; log: {log.name}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return proc, log.name
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    proc.kill()
    raise SystemExit(f"{name} did not become healthy; log: {log.name}")


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(60)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
