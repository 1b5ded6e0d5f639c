"""Config fields declared once: `option` puts a field's default, help and flag spelling in the dataclass, which
every part's command line is generated from (radixgen.common.flags); the small checks the configs share."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import field
from typing import Any


def option(default: Any, help: str, *, choices: Sequence[str] | None = None, flags: Sequence[str] = (),
           any_case: bool = False, several: bool = False) -> Any:
    """A config field and its command-line flag in one place: `radixgen serve` builds its flags from these
    (radixgen.common.flags). `flags`: the flag names when not just `--name-with-dashes` (the first is the
    main one; the others are aliases, e.g. SGLang's). `any_case`: the flag takes its (lowercase) choices in
    any case (the field's check lowers the value too). `several` (tuple fields): one flag may take several
    values (`--lora-paths a=x b=y`, SGLang's form), besides being repeated."""
    meta = {"help": help, "choices": tuple(choices) if choices is not None else None, "flags": tuple(flags),
            "any_case": any_case, "several": several}
    return field(default=default, metadata=meta)


def split_addr(addr: str) -> tuple[str, int]:
    """"host:port" -> (host, port); ValueError naming dist_init_addr otherwise."""
    host, _, port = addr.rpartition(":")
    if not host or not port.isdigit() or not 1 <= int(port) <= 65535:
        raise ValueError(f"dist_init_addr must be host:port with a port in [1, 65535], got {addr!r}")
    return host.strip("[]"), int(port)


def check_choice(name: str, value: Any, choices: Sequence[str]) -> None:
    if value not in choices:
        raise ValueError(f"{name} must be one of {', '.join(choices)}; got {value!r}")
