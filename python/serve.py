"""`python -m radixgen.serve [flags]`: the HTTP server, the same as `radixgen serve` (see --help)."""

from __future__ import annotations

import argparse
import sys

from radixgen.launch import run_server
from radixgen.runtime.server.launch import SERVE_DESCRIPTION, add_server_args, parse_server_args


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="radixgen serve", description=SERVE_DESCRIPTION)
    add_server_args(parser)
    return run_server(parse_server_args(parser, parser.parse_args(argv)))


if __name__ == "__main__":
    sys.exit(main())
