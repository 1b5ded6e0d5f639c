"""For tests that drive a ModelRunner directly: the runner holds only the KV buffers and the table tensor, so
they take slots and table rows from a KV cache manager, one per runner (as the scheduler owns one)."""

from __future__ import annotations

import weakref

from radixgen.runtime.scheduler.kv_manager import KVCacheManager

_managers: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def kv_of(runner) -> KVCacheManager:
    kv = _managers.get(runner)
    if kv is None:
        kv = _managers[runner] = KVCacheManager.for_runner(runner)
    return kv
