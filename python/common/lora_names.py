"""LoRA adapters by name: a request names a loaded adapter with `lora_name`; `lora_path` is a folder (a PEFT
adapter on disk) and only that, in /load_lora_adapter, `--lora-paths` and the offline `LoRARequest`.

Where SGLang's public API names a loaded adapter `lora_path` (its /generate body, its OpenAI extra body, its
`Engine.generate`), that keyword stays accepted as an alias of `lora_name` (`pick_lora_name`). The one check of
a name a request gives is `check_lora_name`; whether the adapter is loaded is the Engine's check.

A loaded adapter's own name (`check_adapter_name`: what /load_lora_adapter and `--lora-paths` give it) and the
`--lora-paths` / `--lora-target-modules` specs are checked here too, where a config is built (both processes) and
where an adapter is loaded, without reading any adapter file.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

# PEFT target module name -> the model's merged projection it maps onto
TARGETS = {"q_proj": "qkv_proj", "k_proj": "qkv_proj", "v_proj": "qkv_proj", "o_proj": "o_proj",
           "gate_proj": "gate_up_proj", "up_proj": "gate_up_proj", "down_proj": "down_proj"}
_NAME = re.compile(r"[A-Za-z0-9_.\-/]{1,128}")


class LoRAAdapterError(ValueError):
    pass


def check_adapter_name(name: object) -> str:
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise LoRAAdapterError(f"LoRA adapter name {name!r}: 1-128 letters, digits or the characters _ . - /")
    return name


def parse_lora_paths(specs: tuple[str, ...] | list[str]) -> list[tuple[str, str]]:
    """(name, path) of each `--lora-paths` entry: NAME=PATH, or a bare PATH named after its folder."""
    out: dict[str, str] = {}
    for spec in specs:
        if not isinstance(spec, str) or not spec:
            raise LoRAAdapterError(f"lora_paths: an entry must be NAME=PATH or PATH, got {spec!r}")
        name, sep, path = spec.partition("=")
        if not sep:
            name, path = Path(spec.rstrip("/")).name, spec
        check_adapter_name(name)
        if not path:
            raise LoRAAdapterError(f"lora_paths: {spec!r} has no path")
        if name in out:
            raise LoRAAdapterError(f"lora_paths: two adapters named {name!r}")
        out[name] = path
    return list(out.items())


def check_target_names(modules: tuple[str, ...] | list[str]) -> None:
    unknown = sorted(set(modules) - TARGETS.keys() - {"all"})
    if unknown:
        raise LoRAAdapterError(f"lora_target_modules: unknown module(s) {unknown} (known: {sorted(TARGETS)}, all)")


def check_lora_name(name: Any, where: str = "lora_name", *, per_prompt: bool = False) -> None:
    """A ValueError naming `where` unless `name` is an adapter name (a non-empty string) or None (the base
    model); with `per_prompt`, a list of those (one per prompt) is accepted too."""
    names = name if per_prompt and isinstance(name, (list, tuple)) else [name]
    for one in names:
        if one is not None and (not isinstance(one, str) or not one):
            shape = " or a list of them (one per prompt)" if per_prompt else ""
            raise ValueError(f"{where}: must be a LoRA adapter's name (a non-empty string){shape}, got {one!r}")


def pick_lora_name(lora_name: Any, lora_path: Any) -> tuple[str, Any]:
    """(the keyword a request used, the adapter it names): `lora_name`, or SGLang's alias `lora_path` (an adapter's
    name there, not a folder), so an error can name what the client sent; ("lora_name", None) for neither. Both
    given and different is a ValueError."""
    if lora_path is None:
        return "lora_name", lora_name
    if lora_name is not None and lora_name != lora_path:
        raise ValueError(f"lora_name and lora_path (its alias) name different adapters: {lora_name!r} and "
                         f"{lora_path!r}; give one")
    return ("lora_name" if lora_name is not None else "lora_path"), lora_path
