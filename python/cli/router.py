"""`radixgen router`: cache-aware routing over several servers."""

from __future__ import annotations

import argparse

from radixgen.router.launch import ROUTER_DESCRIPTION, add_router_args, parse_router_args, run_router

DESCRIPTION = ROUTER_DESCRIPTION


def add_args(parser: argparse.ArgumentParser) -> None:
    add_router_args(parser)


def run(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    return run_router(*parse_router_args(parser, args))
