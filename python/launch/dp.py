"""`radixgen serve --dp-size N`: N worker servers and the router in one command, on one machine.

The workers are `python -m radixgen.serve` subprocesses on loopback, on the N ports after the public one,
each with an equal share of the CPU threads; the router serves the public host and port in this process.
SIGTERM / SIGINT stop the router (it drains its streams), then the workers (they drain theirs)."""

from __future__ import annotations

import dataclasses
import os
import signal
import subprocess
import sys
import time
from typing import Any

import httpx

from radixgen.router.config import RouterConfig
from radixgen.router.launch import run_router
from radixgen.runtime.config import RuntimeConfig

WORKER_HOST = "127.0.0.1"
WORKER_START_TIMEOUT_S = 900.0  # a first start may convert the default model
POLL_S = 0.5


def worker_threads(engine: dict[str, Any], dp_size: int) -> int:
    """Each worker rank's share of --num-threads (0 or absent: of every CPU), at least one: a worker with tensor /
    pipeline parallelism runs tp_size * pp_size ranks, each with this many threads."""
    total = engine.get("num_threads") or os.cpu_count() or 1
    ranks = engine.get("tp_size", 1) * engine.get("pp_size", 1)
    return max(1, total // (dp_size * ranks))


def flags_of(cls: type, values: dict[str, Any]) -> list[str]:
    """The command-line flags that give these field values of the config dataclass `cls` (the inverse of
    radixgen.common.flags): fields left at their default are left out."""
    argv: list[str] = []
    for f in dataclasses.fields(cls):
        if f.name not in values or values[f.name] == f.default:
            continue
        value = values[f.name]
        flag = (f.metadata.get("flags") or ("--" + f.name.replace("_", "-"),))[0]
        if isinstance(value, bool):
            argv.append(flag if value else "--no-" + flag[2:])
        elif isinstance(value, (tuple, list)):
            for v in value:
                argv += [flag, str(v)]
        elif value is not None:
            argv += [flag, str(value)]
    return argv


def worker_commands(args: Any) -> list[list[str]]:
    """One `python -m radixgen.serve` command line per worker. `args`: launch.ServerArgs with dp_size > 1."""
    from radixgen.runtime.server.launch import ServerConfig

    server, n = args.server, args.server.dp_size
    engine = {**args.engine, "num_threads": worker_threads(args.engine, n)}
    commands = []
    for i in range(n):
        # the keys already read from --api-key-file go on the command line of a loopback-only child
        own = {**dataclasses.asdict(server), "host": WORKER_HOST, "port": server.port + 1 + i, "dp_size": 1,
               "api_keys": args.api_keys, "api_key_file": None}
        commands.append([sys.executable, "-m", "radixgen.serve", *flags_of(ServerConfig, own),
                         *flags_of(RuntimeConfig, engine)])
    return commands


def run_dp(args: Any) -> int:
    server = args.server
    urls = tuple(f"http://{WORKER_HOST}:{server.port + 1 + i}" for i in range(server.dp_size))
    workers: list[subprocess.Popen] = []
    previous = signal.signal(signal.SIGTERM, _exit_now)  # a SIGTERM while the workers start: stop them
    try:
        for cmd in worker_commands(args):
            workers.append(subprocess.Popen(cmd, stdin=subprocess.DEVNULL))
        if not _wait_healthy(workers, urls):
            return 1
        signal.signal(signal.SIGTERM, previous)  # uvicorn handles it from here: drain, then return
        config = RouterConfig(host=server.host, port=server.port, api_keys=args.api_keys, log_level=server.log_level)
        return run_router(config, urls)
    finally:
        _stop(workers)


def _wait_healthy(workers: list[subprocess.Popen], urls: tuple[str, ...]) -> bool:
    deadline = time.monotonic() + WORKER_START_TIMEOUT_S
    pending = set(range(len(urls)))
    while pending and time.monotonic() < deadline:
        for i in sorted(pending):
            if workers[i].poll() is not None:
                print(f"radixgen serve --dp-size: worker {i} ({urls[i]}) exited with {workers[i].returncode}",
                      file=sys.stderr)
                return False
            try:
                if httpx.get(f"{urls[i]}/health", timeout=2.0).status_code == 200:
                    pending.discard(i)
            except httpx.HTTPError:
                pass
        time.sleep(POLL_S)
    if pending:
        print(f"radixgen serve --dp-size: workers {sorted(pending)} not healthy after {WORKER_START_TIMEOUT_S:.0f} s",
              file=sys.stderr)
    return not pending


def _stop(workers: list[subprocess.Popen]) -> None:
    """SIGTERM every worker (each drains its requests for up to its grace period), then wait; kill the late."""
    from radixgen.runtime.server.launch import SHUTDOWN_GRACE_S

    for p in workers:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + SHUTDOWN_GRACE_S + 15.0
    for p in workers:
        try:
            p.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def _exit_now(sig: int, frame: Any) -> None:
    raise SystemExit(0)
