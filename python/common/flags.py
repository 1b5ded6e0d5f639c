"""Command-line flags generated from config dataclasses, so that a field's name, type, default, choices and
help are written once (in the dataclass, with `radixgen.common.options.option`) and the CLI cannot drift from them.

    field `max_total_tokens: int = option(0, "KV cache slots")`   ->   `--max-total-tokens INT`
    field `disable_radix_cache: bool = option(False, ...)`         ->   `--disable-radix-cache`
                                            (default True: `--name` and `--no-name`)
    field `api_keys: tuple[str, ...] = option((), ..., flags=("--api-key",))`  ->  `--api-key K` repeated

Flags left out of a command line are absent from the parsed namespace (argparse.SUPPRESS), so the
dataclass's own default applies: `values_of(cls, ns)` returns only what was given.
"""

from __future__ import annotations

import argparse
import dataclasses
import types
import typing
from typing import Any

_SCALARS = (int, float, str)
_METAVARS = {int: "INT", float: "FLOAT", str: "TEXT"}


def add_dataclass_flags(parser: argparse.ArgumentParser | argparse._ArgumentGroup, cls: type) -> None:
    """One flag per field of the dataclass `cls` (dest: the field name)."""
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        meta = f.metadata
        names = list(meta.get("flags") or ()) or ["--" + f.name.replace("_", "-")]
        kind, container = _flag_type(hints[f.name], f"{cls.__name__}.{f.name}")
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()  # type: ignore[misc]
        help_text = meta.get("help", "")
        common: dict[str, Any] = {"dest": f.name, "default": argparse.SUPPRESS}
        if kind is bool:
            parser.add_argument(*names, action="store_true", help=_with_default(help_text, default), **common)
            if default is True:
                negated = ["--no-" + n[2:] for n in names]
                parser.add_argument(*negated, action="store_false", help=f"turn off {names[0]}", **common)
            continue
        opts: dict[str, Any] = {"type": kind, "metavar": _METAVARS[kind]}
        if meta.get("choices"):
            # argparse shows them: {a,b,c}
            opts = {"type": str.lower if meta.get("any_case") else kind, "choices": meta["choices"]}
        if container is not None and meta.get("several"):
            opts.update(action="extend", nargs="+")
            help_text += " (several after one flag, or the flag repeated)"
        elif container is not None:
            opts["action"] = "append"
            help_text += " (repeat the flag for several)"
        parser.add_argument(*names, help=_with_default(help_text, default), **opts, **common)


def values_of(cls: type, ns: argparse.Namespace) -> dict[str, Any]:
    """The fields of `cls` given on the command line, as keyword arguments of `cls`."""
    hints = typing.get_type_hints(cls)
    out = {}
    for f in dataclasses.fields(cls):
        if hasattr(ns, f.name):
            value = getattr(ns, f.name)
            _, container = _flag_type(hints[f.name], f.name)
            out[f.name] = container(value) if container is not None else value
    return out


def _flag_type(annotation: Any, where: str) -> tuple[type, type | None]:
    """(the type argparse converts each value with, the container of a repeated flag or None)."""
    args = typing.get_args(annotation)
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):  # X | None: the flag gives an X
        inner = [a for a in args if a is not type(None)]
        if len(inner) == 1:
            return _flag_type(inner[0], where)
    elif typing.get_origin(annotation) in (list, tuple) and args and args[0] in _SCALARS:
        if typing.get_origin(annotation) is tuple and args[1:] not in ((), (Ellipsis,)):
            raise TypeError(f"{where}: only homogeneous tuples (tuple[X, ...]) can be flags")
        return args[0], typing.get_origin(annotation)
    elif annotation is bool or annotation in _SCALARS:
        return annotation, None
    raise TypeError(f"{where}: no command-line form for the type {annotation!r}")


def _with_default(help_text: str, default: Any) -> str:
    if default is None or default is False or default == ():
        return help_text
    shown = default if not isinstance(default, str) else repr(default)
    return f"{help_text} (default: {shown})".replace("%", "%%")
