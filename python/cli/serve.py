"""`radixgen serve`: the HTTP server (the same as `python -m radixgen.serve`)."""

from __future__ import annotations

import argparse

from radixgen.launch import run_server
from radixgen.runtime.server.launch import SERVE_DESCRIPTION, add_server_args, parse_server_args

DESCRIPTION = SERVE_DESCRIPTION


def add_args(parser: argparse.ArgumentParser) -> None:
    add_server_args(parser)


def run(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    return run_server(parse_server_args(parser, args))
