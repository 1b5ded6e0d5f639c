"""The scheduler package: `Scheduler` (core.py: the step, admission, decode, retraction, finishing), the KV cache
manager (kv_manager.py), the radix tree (radix_cache.py), the scheduler's records (request.py: Req; batch.py:
Batch and the ForwardInput it builds), admission order (policy.py), output processing (output.py) and the process
loop (process.py: `run_scheduler_process`, started by the Engine as `python -m radixgen.runtime.scheduler ARGS`).

The three names below are imported on first use: the executor reads this package's records (batch.ForwardInput)
while the scheduler's core imports the executor, so importing the records must not import the core."""

from __future__ import annotations

import importlib
from typing import Any

_LAZY = {"Scheduler": "core", "KVCacheManager": "kv_manager", "run_scheduler_process": "process"}

__all__ = sorted(_LAZY)


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        value = getattr(importlib.import_module(f"radixgen.runtime.scheduler.{_LAZY[name]}"), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'radixgen.runtime.scheduler' has no attribute {name!r}")
