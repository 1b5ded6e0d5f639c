"""The `radixgen` console script. Subcommands: `serve`, `router`."""

from __future__ import annotations

import argparse

from radixgen.launch import run_server
from radixgen.router.launch import ROUTER_DESCRIPTION, add_router_args, parse_router_args, run_router
from radixgen.runtime.server.launch import SERVE_DESCRIPTION, add_server_args, parse_server_args


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="radixgen")
    commands = parser.add_subparsers(dest="command", required=True)
    serve = commands.add_parser("serve", help="serve a model over HTTP (native and OpenAI-compatible APIs)",
                                description=SERVE_DESCRIPTION)
    add_server_args(serve)
    router = commands.add_parser("router", help="route requests over several servers (data parallelism)",
                                 description=ROUTER_DESCRIPTION)
    add_router_args(router)
    args = parser.parse_args(argv)
    if args.command == "serve":
        return run_server(parse_server_args(serve, args))
    if args.command == "router":
        return run_router(*parse_router_args(router, args))
    parser.error(f"unknown command {args.command!r}")  # pragma: no cover - argparse rejects it first
    return 2


if __name__ == "__main__":
    raise SystemExit(main())
