"""What several commands share: the engine flags, the sampling flags and `/set`'s value parsing (both from the one
SamplingParams declaration), starting an in-process Engine, progress bars, tables."""

from __future__ import annotations

import argparse
import contextlib
import json
import signal
import sys
import time
from dataclasses import fields
from typing import Any

from radixgen.common.sampling_params import SamplingParams

# the flag people know for the generation budget (OpenAI's, vLLM's, llama.cpp's -n), beside --max-new-tokens
SAMPLING_ALIASES = {"max_new_tokens": ("--max-tokens",)}


def progress_enabled() -> bool:
    """Progress bars and load notices only on a terminal: a pipe or a file gets the results alone."""
    return sys.stdout.isatty()


def progress(total: int, desc: str):
    """A tqdm bar on stderr, switched off when stdout is not a terminal."""
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, file=sys.stderr, disable=not progress_enabled(), leave=False)


def notice(text: str) -> None:
    if progress_enabled():
        print(text, file=sys.stderr, flush=True)


# ---------------------------------------------------------------- sampling fields


def sampling_field_names() -> list[str]:
    return [f.name for f in fields(SamplingParams)]


def parse_field_value(name: str, text: str) -> Any:
    """`text` as a value of sampling field `name`, by its declared kind: an int, a float, a bool (true / false), or
    JSON for the others (a plain string where the text is not JSON: `/set stop END`). `none` clears an optional
    field. ValueError naming the field for text that is not of its kind; the range is SamplingParams' to check."""
    known = SamplingParams.__dataclass_fields__
    if name not in known:
        raise ValueError(f"unknown sampling field {name!r} (known: {', '.join(known)})")
    meta = known[name].metadata
    kind, low = meta["kind"], text.strip().lower()
    if low in ("none", "null") and (meta["optional"] or kind is None):
        return None
    try:
        if kind is bool:
            if low not in ("true", "false", "1", "0", "yes", "no", "on", "off"):
                raise ValueError
            return low in ("true", "1", "yes", "on")
        if kind is int:
            return int(text)
        if kind is float:
            return float(text)
    except ValueError:
        raise ValueError(f"{name}: expected {'true or false' if kind is bool else kind.__name__}, got {text!r}") \
            from None
    try:
        return json.loads(text)
    except RecursionError:
        raise ValueError(f"{name}: the value is nested too deeply") from None
    except ValueError:
        return text


def checked_sampling(values: dict[str, Any]) -> dict[str, Any]:
    """`values` checked by SamplingParams (ValueError naming the field); returned as given."""
    SamplingParams.from_dict(values)
    return values


def add_sampling_args(parser: argparse.ArgumentParser) -> None:
    """A flag per sampling field (`--temperature 0.7`, `--stop END` repeated, `--ignore-eos`), except the names the
    parser already has (`--seed` is the engine's): every field can also be given as `--set FIELD=VALUE`."""
    group = parser.add_argument_group("sampling (each checked by SamplingParams; also --set FIELD=VALUE)")
    taken = set(parser._option_string_actions)  # noqa: SLF001 - argparse has no public view of its flags
    for f in fields(SamplingParams):
        flag = "--" + f.name.replace("_", "-")
        if flag in taken:
            continue
        names = [flag, *SAMPLING_ALIASES.get(f.name, ())]
        dest, help_text = f"sp_{f.name}", f.metadata["help"]
        if f.metadata["kind"] is bool:
            on = f.default is not True  # a field on by default shows its --no- flag
            group.add_argument(*names, dest=dest, action="store_true", default=None,
                               help=help_text if on else argparse.SUPPRESS)
            group.add_argument("--no-" + flag[2:], dest=dest, action="store_false",
                               help=argparse.SUPPRESS if on else f"turn off: {help_text}")
        elif f.name in ("stop", "stop_token_ids"):
            group.add_argument(*names, dest=dest, action="append", metavar="VALUE", help=help_text + " (repeat)")
        else:
            group.add_argument(*names, dest=dest, metavar="VALUE", help=help_text)
    group.add_argument("--set", dest="sp_set", action="append", default=[], metavar="FIELD=VALUE",
                       help="any sampling field, as /set in the chat takes it (repeat)")


def sampling_from_args(args: argparse.Namespace, parser: argparse.ArgumentParser) -> dict[str, Any]:
    """The sampling fields given on the command line (checked); a bad one exits 2 naming its flag."""
    values: dict[str, Any] = {}
    flag_of: dict[str, str] = {}
    for name in sampling_field_names():
        raw = getattr(args, f"sp_{name}", None)
        if raw is None:
            continue
        flag = "--" + name.replace("_", "-")
        try:
            if isinstance(raw, bool):
                values[name] = raw
            elif name == "stop":
                values[name] = list(raw)
            elif name == "stop_token_ids":
                values[name] = [parse_field_value("seed", r) for r in raw]  # each an int
            else:
                values[name] = parse_field_value(name, raw)
        except ValueError as e:
            parser.error(f"argument {flag}: {e}")
        flag_of[name] = flag
    for item in args.sp_set:
        name, eq, text = item.partition("=")
        if not eq:
            parser.error(f"argument --set: expected FIELD=VALUE, got {item!r}")
        try:
            values[name.strip()] = parse_field_value(name.strip(), text)
        except ValueError as e:
            parser.error(f"argument --set: {e}")
        flag_of[name.strip()] = "--set"
    try:
        return checked_sampling(values)
    except ValueError as e:
        field = str(e).split(":")[0].removeprefix("sampling_params.")
        parser.error(f"argument {flag_of.get(field, '--set')}: {e}")
    return values  # pragma: no cover - parser.error exits


# ---------------------------------------------------------------- the engine


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    """Every RuntimeConfig field as a flag (--model, --dtype, --max-total-tokens, ...), as `radixgen serve` has."""
    from radixgen.common.flags import add_dataclass_flags
    from radixgen.runtime.config import RuntimeConfig

    add_dataclass_flags(parser.add_argument_group("engine (as `radixgen serve` takes them)"), RuntimeConfig)


def engine_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    from radixgen.common.flags import values_of
    from radixgen.runtime.config import RuntimeConfig

    return values_of(RuntimeConfig, args)


def add_remote_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("server (instead of an in-process engine)")
    group.add_argument("--url", help="a running radixgen (or other OpenAI-compatible) server, e.g. "
                       "http://127.0.0.1:30000")
    group.add_argument("--api-key", help="the server's API key (sent as a Bearer token)")


def check_remote(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    """--url and engine flags exclude each other: a flag that would be ignored is an error."""
    if args.url is None:
        if args.api_key is not None:
            parser.error("argument --api-key: goes with --url")
        return
    if not args.url.startswith(("http://", "https://")):
        parser.error(f"argument --url: expected an http(s) URL, got {args.url!r}")
    given = sorted(engine_kwargs(args))
    if given:
        parser.error(f"argument --url: a server takes no engine flags (got --{given[0].replace('_', '-')})")


@contextlib.contextmanager
def _children_ignore_sigint():
    """The Engine's scheduler runs in a child process of the same process group, which a terminal's Ctrl-C also
    signals: started while SIGINT is ignored, it inherits the disposition (Python keeps an ignored SIGINT), so
    Ctrl-C stops a reply in this process and leaves the scheduler running."""
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


def start_engine(model: str | None, kwargs: dict[str, Any]):
    """An in-process Engine; model load errors come back as ValueError / RuntimeError for the caller to print."""
    from radixgen.runtime.engine import Engine

    notice(f"loading {model or 'the default model'} ...")
    t0 = time.perf_counter()
    with _children_ignore_sigint():
        engine = Engine(model, **kwargs)
    notice(f"loaded in {time.perf_counter() - t0:.1f} s")
    return engine


def print_table(rows: list[dict[str, Any]], columns: list[str] | None = None, file=None) -> None:
    """Rows as an aligned text table (floats with 2 decimals)."""
    if not rows:
        return
    columns = columns or list(rows[0])

    def cell(v: Any) -> str:
        return f"{v:.2f}" if isinstance(v, float) else ("-" if v is None else str(v))

    cells = [[cell(r.get(c)) for c in columns] for r in rows]
    widths = [max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(columns)]
    out = file or sys.stdout
    for row in (columns, *cells):
        print("  ".join(v.ljust(w) for v, w in zip(row, widths, strict=True)).rstrip(), file=out)
