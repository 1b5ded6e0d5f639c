"""`radixgen.global_config`: the process-wide settings SGLang programs set (`sgl.global_config.x = ...`).

What each does here:
- default_backend: the backend of runs that pass none (`set_default_backend` sets it; an Engine is
  wrapped in an EngineBackend when used).
- verbosity: 2 or more prints a program's final text when `run` returns it finished.
- skip_special_tokens_in_output / spaces_between_special_tokens_in_out: sent with every gen when set
  to False (the runtime's defaults are True).
- enable_precache_with_tracing: `run_batch` caches the prompt prefix its programs share before
  starting them (found by tracing the first ones).
- enable_parallel_encoding: stored, no effect: a `concate_and_append` join appends the branches' text,
  which is encoded again through the radix cache (the parent's prefix is a cache hit); radixgen has no
  KV concatenation of independently encoded branches.
Any other name may be set too (SGLang versions differ): it is stored, with a warning that it has no
effect here.
"""

from __future__ import annotations

import warnings
from typing import Any

_KNOWN = {
    "verbosity": 0,
    "default_backend": None,
    "skip_special_tokens_in_output": True,
    "spaces_between_special_tokens_in_out": True,
    "enable_precache_with_tracing": True,
    "enable_parallel_encoding": True,
}


class GlobalConfig:
    def __init__(self) -> None:
        for name, value in _KNOWN.items():
            object.__setattr__(self, name, value)

    def __setattr__(self, name: str, value: Any) -> None:
        if name not in _KNOWN and not name.startswith("_"):
            warnings.warn(f"radixgen.global_config.{name}: not a setting of radixgen; stored, no effect", stacklevel=2)
        object.__setattr__(self, name, value)

    def __repr__(self) -> str:
        return f"GlobalConfig({', '.join(f'{k}={v!r}' for k, v in vars(self).items())})"


global_config = GlobalConfig()

__all__ = ["GlobalConfig", "global_config"]
