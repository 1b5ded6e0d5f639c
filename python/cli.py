"""The `radixgen` console script. Subcommands: `serve`."""

from __future__ import annotations

import argparse

from radixgen.runtime.server.launch import add_server_args, run_server, server_args_from


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="radixgen")
    commands = parser.add_subparsers(dest="command", required=True)
    serve = commands.add_parser("serve", help="serve a model over HTTP (native and OpenAI-compatible APIs)")
    add_server_args(serve)
    args = parser.parse_args(argv)
    if args.command == "serve":
        return run_server(server_args_from(args))
    parser.error(f"unknown command {args.command!r}")  # pragma: no cover - argparse rejects it first
    return 2


if __name__ == "__main__":
    raise SystemExit(main())
