"""`radixgen router` / `python -m radixgen.router`: serve the router app on uvicorn."""

from __future__ import annotations

import argparse
import contextlib
import logging
import signal
from typing import Any

import uvicorn

from radixgen.router.config import RouterConfig, add_router_args, router_args_from

__all__ = ["ROUTER_DESCRIPTION", "add_router_args", "parse_router_args", "run_router", "main"]

ROUTER_DESCRIPTION = "Route requests over radixgen servers (data parallelism): one public endpoint, many workers."
SHUTDOWN_GRACE_S = 30.0  # relayed streams may finish this long after SIGTERM


class _Server(uvicorn.Server):
    """uvicorn re-raises a captured SIGTERM after shutting down, killing the process before the caller's
    cleanup (serve --dp-size stops its workers after the router returns); here it just returns."""

    @contextlib.contextmanager
    def capture_signals(self):
        previous = {sig: signal.signal(sig, self.handle_exit) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    def handle_exit(self, sig: int, frame: Any) -> None:
        if self.should_exit:  # a second signal: stop waiting for the streams
            self.force_exit = True
        self.should_exit = True


def run_router(config: RouterConfig, worker_urls: tuple[str, ...]) -> int:
    from radixgen.router.app import create_router_app

    logging.basicConfig(level=config.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per health check otherwise
    app = create_router_app(config, worker_urls)
    uv_config = uvicorn.Config(
        app, host=config.host, port=config.port, log_level=config.log_level, timeout_graceful_shutdown=SHUTDOWN_GRACE_S
    )
    _Server(uv_config).run()
    return 0


def parse_router_args(parser: argparse.ArgumentParser, ns: argparse.Namespace) -> tuple[RouterConfig, tuple[str, ...]]:
    """router_args_from, with a refused value reported as the parser's usage error (exit status 2)."""
    try:
        return router_args_from(ns)
    except ValueError as e:
        parser.error(str(e))


def build_parser(prog: str = "radixgen router") -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=prog, description=ROUTER_DESCRIPTION)
    add_router_args(parser)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    return run_router(*parse_router_args(parser, parser.parse_args(argv)))
