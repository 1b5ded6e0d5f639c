"""One file per architecture, each declaring its parts and weight mapping (models/decoder.Architecture) and a
CausalLM subclass; the registry maps a config's `architectures` entry to that class. Adding a model: its file
and one entry here."""

from __future__ import annotations

import importlib

from radixgen.runtime.architectures import ARCHITECTURES as _ARCHITECTURES
from radixgen.runtime.architectures import architecture_of  # noqa: F401 - the registry's public name


def _load(module: str, cls: str):
    return getattr(importlib.import_module(f"radixgen.runtime.models.{module}"), cls)


def model_class(architecture: str):
    for arch, module, cls in _ARCHITECTURES.values():
        if arch == architecture:
            return _load(module, cls)
    raise ValueError(f"unknown architecture key {architecture!r}")


def for_gguf(gguf_arch: str, experts: bool = False):
    """(HF architecture name, models.decoder.Architecture) of GGUF files whose general.architecture is `gguf_arch`,
    or None where no registered model reads them. experts: the file has expert blocks (its expert_count > 0), which
    prefers the architecture with expert weights (llama.cpp writes Mixtral as "llama")."""
    found = []
    for hf_name, (_, module, cls) in _ARCHITECTURES.items():
        declared = _declared(module, cls)
        if declared is not None and declared.gguf_arch == gguf_arch:
            found.append((bool(declared.weights.experts) != experts, hf_name, declared))
    return min(found, key=lambda f: f[0])[1:] if found else None


def _declared(module: str, cls: str):
    """A text model's Architecture declaration; None for a vision-language model (no GGUF files are read)."""
    return getattr(_load(module, cls), "architecture", None)


def gguf_architectures() -> list[str]:
    """The GGUF general.architecture values the registered models read."""
    return sorted({d.gguf_arch for _, m, c in _ARCHITECTURES.values() if (d := _declared(m, c)) is not None} - {None})
