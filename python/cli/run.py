"""`radixgen run PROGRAM.py`: run a file's @function program on an in-process Engine (--model) or a server
(--url) and print its variables; `--batch FILE.jsonl` runs it once per line of arguments (run_batch)."""

from __future__ import annotations

import argparse
import inspect
import json
import runpy
import sys
from pathlib import Path
from typing import Any

from radixgen.cli.common import (
    add_engine_args,
    add_remote_args,
    add_sampling_args,
    check_remote,
    engine_kwargs,
    progress_enabled,
    sampling_from_args,
    start_engine,
)

DESCRIPTION = __doc__.removeprefix("`radixgen run PROGRAM.py`: ").replace("\n", " ")
USAGE = ("radixgen run PROGRAM.py [--function NAME] [--model M | --url URL [--api-key KEY]] [--arg NAME=VALUE ...] "
         "[--batch FILE.jsonl] [--json] [sampling flags] [engine flags]")


def add_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("program", metavar="PROGRAM", help="a Python file defining one or more @function programs")
    parser.add_argument("--function", help="which program of the file (needed when it defines several)")
    parser.add_argument("--arg", action="append", default=[], metavar="NAME=VALUE",
                        help="a program argument (VALUE as JSON, else as a string); repeat")
    parser.add_argument("--batch", metavar="FILE.jsonl", help="one JSON object of arguments per line: run_batch over "
                        "them (--arg values are the defaults of every row)")
    parser.add_argument("--json", action="store_true", help="print JSON (one line per row with --batch)")
    add_remote_args(parser)
    add_engine_args(parser)
    add_sampling_args(parser)


def _value(text: str, parser: argparse.ArgumentParser) -> Any:
    try:
        return json.loads(text)
    except RecursionError:
        parser.error("argument --arg: the value is nested too deeply")
    except ValueError:
        return text


class ProgramLoadError(RuntimeError):
    """The program file raised while it was being executed."""


def load_function(path: Path, name: str | None, parser: argparse.ArgumentParser):
    from radixgen.lang import Function

    if not path.is_file() or path.suffix != ".py":
        parser.error(f"argument PROGRAM: not a Python file: {path}")
    sys.path.insert(0, str(path.resolve().parent))  # the program may import its neighbours
    # another __name__ than "__main__": a file's own `if __name__ == "__main__":` block does not run
    try:
        namespace = runpy.run_path(str(path), run_name="__radixgen_run__")
    except Exception as e:  # noqa: BLE001 - the file's own error, reported with its place
        import traceback

        where = traceback.extract_tb(e.__traceback__)[-1]
        raise ProgramLoadError(f"{path} failed to load: {type(e).__name__}: {e} (line {where.lineno} of "
                               f"{where.filename})") from None
    programs = {k: v for k, v in namespace.items() if isinstance(v, Function)}
    if not programs:
        parser.error(f"argument PROGRAM: {path} defines no @function program")
    if name is not None:
        if name not in programs:
            parser.error(f"argument --function: {path} has no program {name!r} (it has: {', '.join(programs)})")
        return programs[name]
    if len(programs) > 1:
        parser.error(f"argument --function: {path} defines several programs ({', '.join(programs)}): name one")
    return next(iter(programs.values()))


def _check_args(fn, args: dict[str, Any], where: str, parser: argparse.ArgumentParser) -> dict[str, Any]:
    unknown = sorted(set(args) - set(fn.arg_names))
    if unknown:
        parser.error(f"argument {where}: {fn.__name__} takes no argument {unknown[0]!r} "
                     f"(it takes: {', '.join(fn.arg_names) or 'none'})")
    try:
        fn.signature.bind(**{**fn.bind_arguments, **args})
    except TypeError as e:
        parser.error(f"argument {where}: {fn.__name__}: {e}")
    return args


def read_rows(path: str, defaults: dict[str, Any], fn, parser: argparse.ArgumentParser) -> list[dict[str, Any]]:
    try:
        lines = Path(path).read_text().splitlines()
    except OSError as e:
        parser.error(f"argument --batch: {e}")
    rows = []
    for i, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except RecursionError:
            parser.error(f"argument --batch: line {i} is nested too deeply")
        except ValueError as e:
            parser.error(f"argument --batch: line {i} is not JSON: {e}")
        if not isinstance(row, dict):
            parser.error(f"argument --batch: line {i} must be a JSON object of arguments")
        rows.append(_check_args(fn, {**defaults, **row}, f"--batch (line {i})", parser))
    if not rows:
        parser.error(f"argument --batch: {path} has no rows")
    return rows


def _run_keywords(sampling: dict[str, Any], parser: argparse.ArgumentParser) -> dict[str, Any]:
    from radixgen.lang import Function

    taken = set(inspect.signature(Function.run_batch).parameters)
    for name in sampling:
        if name not in taken:
            parser.error(f"argument --{name.replace('_', '-')}: a program run does not take {name} (set it in the "
                         "program's gen(...))")
    return sampling


def _print_state(state, as_json: bool, row: int | None = None) -> bool:
    err = state.error()
    doc = {"variables": state.variables, "error": None if err is None else str(err)}
    if row is not None:
        doc = {"row": row, **doc}
    if as_json:
        print(json.dumps(doc, ensure_ascii=False, default=str), flush=True)
        return err is None
    if row is not None:
        print(f"== row {row}")
    for name, value in doc["variables"].items():
        text = value if isinstance(value, str) else json.dumps(value, ensure_ascii=False, default=str)
        print(f"{name}: {text}")
    if err is not None:
        print(f"error: {err}", file=sys.stderr)
    return err is None


def run(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    check_remote(args, parser)
    keywords = _run_keywords(sampling_from_args(args, parser), parser)
    try:
        fn = load_function(Path(args.program), args.function, parser)
    except ProgramLoadError as e:
        print(f"radixgen run: {e}", file=sys.stderr)
        return 1
    defaults = {}
    for item in args.arg:
        name, eq, text = item.partition("=")
        if not eq or not name:
            parser.error(f"argument --arg: expected NAME=VALUE, got {item!r}")
        defaults[name.strip()] = _value(text, parser)
    rows = read_rows(args.batch, defaults, fn, parser) if args.batch else [_check_args(fn, defaults, "--arg", parser)]
    try:
        if args.url is not None:
            from radixgen.lang.backend_http import RuntimeEndpoint

            backend = RuntimeEndpoint(args.url, api_key=args.api_key)
        else:
            kwargs = engine_kwargs(args)
            backend = start_engine(kwargs.pop("model", None), kwargs)
    except (ValueError, RuntimeError, OSError) as e:
        print(f"radixgen run: {e}", file=sys.stderr)
        return 1
    try:
        if args.batch:
            states = fn.run_batch(rows, backend=backend, progress_bar=progress_enabled(), **keywords)
            ok = [_print_state(st, args.json, i) for i, st in enumerate(states)]
            return 0 if all(ok) else 1
        try:
            state = fn.run(**rows[0], backend=backend, **keywords)
        except Exception as e:  # noqa: BLE001 - a ProgramError names the failing line; others are the program's
            print(f"radixgen run: {fn.__name__} failed: {e}", file=sys.stderr)
            return 1
        return 0 if _print_state(state, args.json) else 1
    finally:
        if hasattr(backend, "shutdown"):
            backend.shutdown()
