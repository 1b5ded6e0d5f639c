"""The `radixgen` console script: one module per command, imported only when that command runs.

`radixgen --help` lists the commands without importing any of them (torch, the server stack), so that a command
that needs neither (`radixgen models list`) starts at once. Each command module declares DESCRIPTION (and USAGE
where the generated one is too long), `add_args(parser)` and `run(args, parser) -> exit code`; a bad argument is
`parser.error(...)`: exit 2 naming it.
"""

from __future__ import annotations

import argparse
import importlib
import sys

# command -> (module, one line of help)
COMMANDS = {
    "serve": ("radixgen.cli.serve", "serve a model over HTTP (native and OpenAI-compatible APIs)"),
    "router": ("radixgen.cli.router", "route requests over several servers (data parallelism)"),
    "chat": ("radixgen.cli.chat", "chat with a model in the terminal (in-process, or a server with --url)"),
    "complete": ("radixgen.cli.complete", "complete one prompt (an argument or stdin) and print the text"),
    "run": ("radixgen.cli.run", "run a file's @function program and print its variables"),
    "bench": ("radixgen.cli.bench", "benchmarks: latency, throughput, serve (a running server), cache"),
    "models": ("radixgen.cli.models", "the converted-model cache: list, show, rm"),
    "env": ("radixgen.cli.env", "what this machine and build can do (CPU features, kernels, versions, GPU)"),
}


def _top_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="radixgen", description="radixgen: structured generation programs "
                                     "over a radix-tree KV cache runtime. `radixgen COMMAND --help` for each.")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, (_, help_text) in COMMANDS.items():
        commands.add_parser(name, help=help_text, add_help=False)
    return parser


def command_parser(name: str):
    """The module and the argument parser of command `name`."""
    module = importlib.import_module(COMMANDS[name][0])
    parser = argparse.ArgumentParser(prog=f"radixgen {name}", description=module.DESCRIPTION,
                                     usage=getattr(module, "USAGE", None))
    module.add_args(parser)
    return module, parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] not in COMMANDS:
        _top_parser().parse_args(argv)  # prints the help, or exits 2 naming the unknown command
        return 2  # pragma: no cover - parse_args exits first
    module, parser = command_parser(argv[0])
    return module.run(parser.parse_args(argv[1:]), parser)


if __name__ == "__main__":
    raise SystemExit(main())
