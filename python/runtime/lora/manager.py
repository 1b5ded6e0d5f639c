"""The LoRA manager: the scheduler's one owner of adapter slots.

It knows the adapters by name (registered at start from --lora-paths, or at run time by `load`; `unload` takes
one away), which adapter sits in which slot of the pool (runner.lora_pool), and which requests use them:
    start / end        a request naming an adapter, from take-in to its end (the adapter's `users`)
    acquire / release  a request holds its adapter's slot (the slot's `refs`) from the end of its wait for it
                       until it ends or is retracted (then it waits again)
A request whose adapter is not resident waits (acquire says False: the scheduler's AdapterSlot condition polls
it, scheduler/waits.py) while the adapter is read from disk on the manager's thread, then copied into a slot
between steps (`poll`); it never fails for that reason, and other requests keep running; it fails when the read
does (`read_failures`). Slots are replaced least recently used first among those no request holds
(pinned adapters stay); when every slot is held, the least recently used unpinned one is drained: it takes no
new request until its running ones end, then it is replaced.

Cache: a request's radix-tree namespace is (its cache salt, its adapter's load id): the KV of a prefix differs
per adapter, and a reloaded name never meets the old one's entries. The hierarchical cache's disk tier, which
outlives the process, names an adapter's pages by the digest of its weights instead (`digest_of`). `unload`
evicts the adapter's unlocked entries at once; requests already in flight for it run to their end (new ones are
refused: unknown adapter), and when the last one ends its slot is freed and the rest of its entries evicted.
"""

from __future__ import annotations

import hashlib
import itertools
import logging
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch

from radixgen.runtime.lora.adapter import (
    LoRAAdapterError,
    check_adapter_fits,
    check_adapter_name,
    load_lora_adapter,
    parse_lora_paths,
)
from radixgen.runtime.lora.pool import LoRAPool, StagedAdapter
from radixgen.runtime.messages import ControlReply, LoadLoRAAdapter, LoRAUpdate, UnloadLoRAAdapter

logger = logging.getLogger(__name__)


def staged_digest(staged: StagedAdapter) -> str:
    """What the adapter does to KV, as a hash: its scale, its ranks and every weight's bytes as laid out in a slot
    (another adapter, or the same one changed on disk, gives another digest)."""
    h = hashlib.sha256(f"{staged.scale!r}|{staged.ranks!r}".encode())
    for key in sorted(staged.weights):
        h.update(repr(key).encode())
        for t in staged.weights[key]:
            h.update(str(t.dtype).encode())
            h.update(t.detach().contiguous().cpu().reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


NOT_ENABLED = "LoRA adapters are not enabled on this server (start it with --lora-paths or --enable-lora)"


@dataclass(eq=False)
class AdapterEntry:
    name: str
    path: str
    uid: int  # distinct per load: the cache namespace of its requests
    pinned: bool = False
    users: int = 0  # requests in the scheduler that name it
    slot: int = -1  # its pool slot while resident or loading into one
    unloaded: bool = False
    read_failures: int = 0  # reads for a request that failed (a request waiting for its slot watches this)
    read_error: BaseException | None = None  # the last one's
    digest: str | None = None  # of its weights (staged_digest): its pages' namespace in the disk KV tier


@dataclass(eq=False)
class _Slot:
    entry: AdapterEntry | None = None
    refs: int = 0  # admitted requests using it
    last_used: int = 0
    loading: Future | None = None  # the entry's weights being read for this slot
    draining: bool = False  # takes no new request: to be replaced once its running ones end


@dataclass(eq=False)
class _Registration:
    """A run-time load being read on the manager's thread; answered by `poll`."""

    name: str
    path: str
    pinned: bool
    future: Future
    reply: Callable[[str | None], None]  # called with None on success, else the error message


class LoRAManager:
    def __init__(self, pool: LoRAPool | None, model_config,
                 evict_namespaces: Callable[[Callable[[object], bool]], int]) -> None:
        """`pool`: the runner's (None: LoRA is not enabled, and every adapter request is refused saying so).
        `evict_namespaces(belongs)`: the KV cache manager's, freeing the unlocked tree entries of every namespace
        for which belongs(namespace) is true."""
        self.pool, self.model_config, self.evict_namespaces = pool, model_config, evict_namespaces
        self.adapters: dict[str, AdapterEntry] = {}
        self.slots = [_Slot() for _ in range(pool.num_slots if pool is not None else 0)]
        self.registrations: list[_Registration] = []
        self._uids = itertools.count(1)
        self._clock = 0
        self.loads_from_disk = 0  # adapters read for a request (not counting registrations)
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="radixgen-lora")  # disk reads off the loop

    @classmethod
    def for_scheduler(cls, cfg, runner, evict_namespaces) -> LoRAManager:
        """The manager of a scheduler's runner, with the --lora-paths adapters registered (see load_at_start)."""
        manager = cls(runner.lora_pool, runner.model_config, evict_namespaces)
        manager.load_at_start(parse_lora_paths(cfg.lora_paths))
        return manager

    # ------------------------------------------------------------------ registration: load / unload

    def handle(self, msg: LoadLoRAAdapter | UnloadLoRAAdapter, send: Callable[[ControlReply], None]) -> None:
        """A load or unload message: its ControlReply (a LoRAUpdate) is sent now, or once the load is read."""
        def reply(error: str | None) -> None:
            send(ControlReply(msg.reply_id, LoRAUpdate(error, self.listing())))

        if self.pool is None:
            reply(NOT_ENABLED)
        elif isinstance(msg, LoadLoRAAdapter):
            self.load(msg.name, msg.path, msg.pinned, reply)
        else:
            try:
                self.unload(msg.name)
            except LoRAAdapterError as e:
                reply(str(e))
                return
            reply(None)

    def load_at_start(self, specs: list[tuple[str, str]]) -> None:
        """Register the --lora-paths adapters, reading each now (a bad one fails the start, naming it); the
        first `num_slots` stay resident."""
        for name, path in specs:
            staged = self._read(name, path)
            entry = self._register(name, path, pinned=False)
            entry.digest = staged_digest(staged)
            slot = self._free_slot(evict=False)
            if slot is not None:
                self._install(entry, slot, staged)

    def load(self, name: str, path: str, pinned: bool, reply: Callable[[str | None], None]) -> None:
        """Register an adapter at run time: read and checked on the manager's thread, then `reply(None)` from
        `poll` (resident at once if a slot is free, or pinned), or reply(the problem)."""
        try:
            check_adapter_name(name)
            if not isinstance(path, str) or not path:
                raise LoRAAdapterError(f"LoRA adapter {name!r}: lora_path must be a non-empty string")
            if name in self.adapters or any(r.name == name for r in self.registrations):
                raise LoRAAdapterError(f"LoRA adapter {name!r} is already loaded (unload it first)")
            pinned_now = sum(e.pinned for e in self.adapters.values()) + sum(r.pinned for r in self.registrations)
            if pinned and pinned_now + 1 >= len(self.slots):
                raise LoRAAdapterError(f"LoRA adapter {name!r}: cannot pin it: at most max_loras - 1 = "
                                       f"{len(self.slots) - 1} adapters may be pinned")
        except LoRAAdapterError as e:
            reply(str(e))
            return
        self.registrations.append(_Registration(name, path, pinned, self._thread.submit(self._read_new, name, path),
                                                reply))

    def unload(self, name: str) -> None:
        """Forget an adapter: new requests naming it are refused; those in flight run to their end."""
        entry = self.adapters.get(name)
        if entry is None:
            raise LoRAAdapterError(f"no LoRA adapter named {name!r} is loaded (loaded: {sorted(self.adapters)})")
        del self.adapters[name]
        entry.unloaded = True
        self._evict_entries(entry)
        if entry.users == 0:
            self._drop(entry)

    def listing(self) -> dict[str, str]:
        """name -> path of the loaded adapters."""
        return {name: e.path for name, e in self.adapters.items()}

    # ------------------------------------------------------------------ requests: start / end

    def start(self, req) -> None:
        """A request naming an adapter enters the scheduler: its namespace becomes (cache salt, adapter load id).
        LoRAAdapterError when the adapter is unknown."""
        if self.pool is None:
            raise LoRAAdapterError(NOT_ENABLED)
        entry = self.adapters.get(req.lora_name)
        if entry is None:
            raise LoRAAdapterError(f"unknown LoRA adapter {req.lora_name!r} (loaded: {sorted(self.adapters)})")
        entry.users += 1
        req.lora = entry
        req.namespace = (req.namespace, entry.uid)

    def end(self, req) -> None:
        """The request has ended (its KV already given back)."""
        entry = req.lora
        if entry is None:
            return
        self.release(req)
        req.lora = None
        entry.users -= 1
        if entry.unloaded and entry.users == 0:
            self._drop(entry)

    # ------------------------------------------------------------------ slots: acquire / release

    def acquire(self, req) -> bool:
        """Hold the slot of the request's adapter (req.lora_slot); False while it is not resident (its load is
        started when a slot can be had)."""
        if req.lora_slot >= 0:
            return True
        entry = req.lora
        if entry.slot >= 0:
            s = self.slots[entry.slot]
            if s.loading is not None or s.draining:
                return False
            s.refs += 1
            s.last_used = self._tick()
            req.lora_slot = entry.slot
            return True
        slot = self._free_slot()
        if slot is None:
            self._drain_one()
            return False
        s = self.slots[slot]
        s.entry, s.last_used, entry.slot = entry, self._tick(), slot
        s.loading = self._thread.submit(self._read, entry.name, entry.path)
        self.loads_from_disk += 1
        return False

    def release(self, req) -> None:
        if req.lora_slot >= 0:
            self.slots[req.lora_slot].refs -= 1
            req.lora_slot = -1

    # ------------------------------------------------------------------ each step

    @property
    def busy(self) -> bool:
        """Something is being read on the manager's thread."""
        return bool(self.registrations) or any(s.loading is not None for s in self.slots)

    def poll(self) -> list[tuple[AdapterEntry, BaseException]]:
        """Install what the thread has read (between steps); answer finished registrations. Returns the
        adapters whose read for a request failed (their waiting requests cannot run)."""
        failed = []
        for i, s in enumerate(self.slots):
            if s.loading is None or not s.loading.done():
                continue
            future, s.loading = s.loading, None
            try:
                staged = future.result()
            except Exception as e:  # noqa: BLE001 - the adapter's file went bad since it was registered
                logger.error("reading LoRA adapter %r failed: %s", s.entry.name, e)
                failed.append((s.entry, e))
                s.entry.read_failures += 1
                s.entry.read_error = e
                s.entry.slot, s.entry = -1, None
                continue
            self._install(s.entry, i, staged)
        for reg in [r for r in self.registrations if r.future.done()]:
            try:
                staged, digest = reg.future.result()
            except Exception as e:  # noqa: BLE001 - the caller's adapter is bad: its 400
                self.registrations.remove(reg)
                reg.reply(str(e) if isinstance(e, LoRAAdapterError) else f"{type(e).__name__}: {e}")
                continue
            # resident now if a slot is empty; a pinned adapter is resident from its load on, so it waits for a
            # slot (draining one) before it is answered
            slot = self._free_slot(evict=reg.pinned)
            if slot is None and reg.pinned:
                self._drain_one()
                continue
            self.registrations.remove(reg)
            entry = self._register(reg.name, reg.path, reg.pinned)
            entry.digest = digest
            if slot is not None:
                self._install(entry, slot, staged)
            reg.reply(None)
        return failed

    def info(self) -> dict | None:
        if self.pool is None:
            return None
        return {"max_loras": len(self.slots), "max_lora_rank": self.pool.max_rank,
                "target_modules": sorted(self.pool.targets), "adapters": self.listing(),
                "resident": [None if s.entry is None or s.loading is not None else s.entry.name for s in self.slots],
                "loads_from_disk": self.loads_from_disk}

    def shutdown(self) -> None:
        self._thread.shutdown(wait=False, cancel_futures=True)

    # ------------------------------------------------------------------ internals

    def _read(self, name: str, path: str) -> StagedAdapter:
        """Read, check and lay out an adapter folder (the manager's thread, or the start)."""
        adapter = load_lora_adapter(name, path, max_lora_rank=self.pool.max_rank)
        check_adapter_fits(adapter, self.model_config)
        return self.pool.stage(adapter)

    def _read_new(self, name: str, path: str) -> tuple[StagedAdapter, str]:
        """A run-time registration's read (the manager's thread): the staged adapter and its digest."""
        staged = self._read(name, path)
        return staged, staged_digest(staged)

    def digest_of(self, uid: int) -> str | None:
        """The weights' digest of the adapter loaded as `uid` (None: unloaded meanwhile): the hierarchical
        cache's disk tier names an adapter's pages by it."""
        for entry in self.adapters.values():
            if entry.uid == uid:
                return entry.digest
        return None

    def _register(self, name: str, path: str, pinned: bool) -> AdapterEntry:
        entry = AdapterEntry(name, path, next(self._uids), pinned)
        self.adapters[name] = entry
        return entry

    def _install(self, entry: AdapterEntry, slot: int, staged: StagedAdapter) -> None:
        self.pool.write(slot, staged)
        s = self.slots[slot]
        s.entry, s.refs, s.draining, s.last_used = entry, 0, False, self._tick()
        entry.slot = slot

    def _free_slot(self, evict: bool = True) -> int | None:
        """An empty slot, else (with `evict`) the least recently used one that nothing holds or loads, its
        adapter evicted."""
        empty = [i for i, s in enumerate(self.slots) if s.entry is None]
        if empty or not evict:
            return empty[0] if empty else None
        idle = [i for i, s in enumerate(self.slots) if s.refs == 0 and s.loading is None and not s.entry.pinned]
        if not idle:
            return None
        i = min(idle, key=lambda j: self.slots[j].last_used)
        s = self.slots[i]
        s.entry.slot, s.entry, s.draining = -1, None, False
        return i

    def _drain_one(self) -> None:
        if any(s.draining for s in self.slots):
            return
        held = [s for s in self.slots if s.entry is not None and s.loading is None and not s.entry.pinned]
        if held:
            min(held, key=lambda s: s.last_used).draining = True

    def _drop(self, entry: AdapterEntry) -> None:
        """The last request of an unloaded adapter has ended: free its slot and its cache entries."""
        if entry.slot >= 0:
            s = self.slots[entry.slot]
            s.entry, s.loading, s.draining = None, None, False
            entry.slot = -1
        self._evict_entries(entry)

    def _evict_entries(self, entry: AdapterEntry) -> None:
        uid = entry.uid
        freed = self.evict_namespaces(lambda ns: isinstance(ns, tuple) and ns[1] == uid)
        if freed:
            logger.info("evicted %d cached tokens of LoRA adapter %r", freed, entry.name)

    def _tick(self) -> int:
        self._clock += 1
        return self._clock
