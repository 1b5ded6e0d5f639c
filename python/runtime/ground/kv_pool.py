"""The paged KV pool: per-layer K/V buffers indexed by slot, a free-slot allocator, the request->slot table.

The model runner holds the buffers and the table tensor; the KV cache manager (scheduler/kv_manager.py) owns
the allocator and the table's rows.

A request's tokens may live in any slots: attention reads and writes KV only through slot indices,
which is what lets the radix tree share a prefix's slots between requests.

Longer than 400 lines: the pools, their row copies between tiers (C and torch paths) and the slot allocator
belong together; splitting the copies out is next."""

from __future__ import annotations

import contextlib
import threading
from typing import NamedTuple

import torch

from radixgen.kernels import cpu, cpu_kv_copy
from radixgen.kernels.kv_quant import SCALE_DTYPE, code_bits, dequantize_kv_ref, gather_codes, quantize_kv_ref


@contextlib.contextmanager
def _no_huge_pages(np):
    """numpy's madvise(MADV_HUGEPAGE) on large allocations off, for the allocations inside (a private numpy switch:
    where it is missing, allocations keep numpy's default)."""
    core = getattr(np, "_core", None) or getattr(np, "core", None)
    switch = getattr(getattr(core, "multiarray", None), "_set_madvise_hugepage", None)
    if switch is None:
        yield
        return
    before = switch(False)
    try:
        yield
    finally:
        switch(before)


def zeros_untouched(shape: tuple[int, ...], dtype: torch.dtype, device: str | torch.device,
                    huge_pages: bool = False) -> torch.Tensor:
    """A zero tensor whose host pages are not touched until written.

    On the CPU, torch.zeros writes every byte, so a 2 GiB pool is resident from the start; numpy's zeros takes
    fresh zero pages from the kernel (calloc), so the process's resident memory grows with the KV actually used.
    `huge_pages` False (the default): no transparent huge pages, as torch's own CPU allocations. numpy asks for
    them on large arrays, and where the kernel compacts memory for them on demand (defrag `madvise`, a common
    default) the first write to each 2 MiB waits for a huge page to be found and zeroed. Measured on a machine up
    for hours: 2048 KV rows written at scattered rows of a fresh pool took 6.9 s with them, 0.21 s without (4 KiB
    pages, about 2 us each), and a restarted server's first request over a 2k-token prefix from disk 0.4-1.2 s
    against a steady 0.36 s. Once touched, huge pages make attention over a 1024-token cache about 10% faster and
    decode 4-8% (fewer TLB misses): --kv-huge-pages takes them for the device pool."""
    if torch.device(device).type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    import numpy as np

    nbytes = torch.Size(shape).numel() * _element_size(dtype)
    with contextlib.nullcontext() if huge_pages else _no_huge_pages(np):
        raw = np.zeros(nbytes + 4096, dtype=np.uint8)
    start = -raw.ctypes.data % 4096  # page-aligned, as torch's allocator would give (vector loads within lines)
    return torch.from_numpy(raw)[start:start + nbytes].view(dtype).view(shape)


class KVLayer(NamedTuple):
    """One layer's pool tensors, as the kernels take them."""

    k: torch.Tensor  # (num_slots, Hkv, D): values in the model dtype, or 8-bit codes
    v: torch.Tensor
    k_scales: torch.Tensor | None  # (num_slots, Hkv) bfloat16 scales of an 8-bit pool, else None
    v_scales: torch.Tensor | None

    def scales(self) -> dict:
        """The kernels' scale keywords: none for a pool in the model dtype."""
        return {} if self.k_scales is None else {"k_scales": self.k_scales, "v_scales": self.v_scales}


class KVPool:
    """K and V buffers of shape (num_slots, num_kv_heads, head_dim) for each layer. Slot 0 is padding.

    With `code_dtype` (int8 or float8_e4m3fn, RuntimeConfig.kv_cache_dtype) the buffers hold 8-bit codes and
    each layer has K and V scales (num_slots, num_kv_heads) bfloat16 beside them: every (slot, head) row is
    quantized once when it is stored (radixgen.kernels.kv_quant), and attention reads values in `dtype`.

    With `window_layers` (per layer: in the window group, ground/window_kv.py) those layers' buffers have
    `window_slots` rows instead, indexed by the window table's slots; rows copies between tiers then refuse it."""

    def __init__(self, num_layers: int, num_slots: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: str | torch.device = "cpu", code_dtype: torch.dtype | None = None,
                 huge_pages: bool = False, window_layers: tuple[bool, ...] = (), window_slots: int = 0) -> None:
        self.num_slots = num_slots
        self.dtype, self.code_dtype = dtype, code_dtype
        if window_layers and (len(window_layers) != num_layers or window_slots < 2):
            raise ValueError(f"window_layers: one flag per layer ({num_layers}) and window_slots >= 2")
        self.window_layers, self.window_slots = tuple(window_layers) or (False,) * num_layers, window_slots
        shape = (num_slots, num_kv_heads, head_dim)

        def buffers(shape, dtype) -> list[torch.Tensor]:
            return [zeros_untouched((window_slots if w else shape[0], *shape[1:]), dtype, device, huge_pages)
                    for w in self.window_layers]

        self.k_buffers, self.v_buffers = buffers(shape, code_dtype or dtype), buffers(shape, code_dtype or dtype)
        self.k_scales = self.v_scales = None
        self._c_buffers = None
        if code_dtype is not None:
            self.k_scales, self.v_scales = buffers(shape[:2], SCALE_DTYPE), buffers(shape[:2], SCALE_DTYPE)

    @property
    def quantized(self) -> bool:
        return self.code_dtype is not None

    def layer(self, i: int) -> KVLayer:
        if self.k_scales is None:
            return KVLayer(self.k_buffers[i], self.v_buffers[i], None, None)
        return KVLayer(self.k_buffers[i], self.v_buffers[i], self.k_scales[i], self.v_scales[i])

    @staticmethod
    def bytes_per_slot(num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
                       code_dtype: torch.dtype | None = None) -> int:
        """K and V of one token over all layers: D values per head, or D codes and a scale per head."""
        if code_dtype is None:
            per_head = head_dim * _element_size(dtype)
        else:
            per_head = head_dim * _element_size(code_dtype) + _element_size(SCALE_DTYPE)
        return 2 * num_layers * num_kv_heads * per_head

    def nbytes(self) -> int:
        tensors = self.k_buffers + self.v_buffers + (self.k_scales or []) + (self.v_scales or [])
        return sum(t.numel() * t.element_size() for t in tensors)

    def windowed(self, i: int) -> bool:
        """Whether layer i is in the window group (its rows are window slots)."""
        return self.window_layers[i]

    def refuse_windowed(self, what: str) -> None:
        if any(self.window_layers):
            raise ValueError(f"{what}: a pool whose window layers keep only their last tokens has rows of two kinds")

    def read_rows(self, index: torch.Tensor) -> list[torch.Tensor]:
        """A copy of rows `index` of every buffer, in `buffers` order, on the host (a page written to disk)."""
        self.refuse_windowed("read_rows")
        index = index.to(self.k_buffers[0].device, torch.int64)
        with one_thread():
            return [_gather(b, index).cpu() for b in self.buffers()]

    def write_rows(self, index: torch.Tensor, rows: list[torch.Tensor]) -> None:
        """The inverse of `read_rows`: rows (in `buffers` order, this pool's format) stored at `index`."""
        self.refuse_windowed("write_rows")
        bufs = self.buffers()
        if len(rows) != len(bufs):
            raise ValueError(f"write_rows: {len(rows)} tensors for a pool of {len(bufs)} buffers")
        kl = self._c_writes(index, rows)
        if kl is not None:  # one C call for every buffer (a disk page is 120 tensors for a 30-layer 8-bit tier)
            di = index.to(torch.int64).contiguous()
            n = 2 * len(self.k_buffers)
            src = cpu_kv_copy.pool_buffers(rows[:n], rows[n:] or None)
            cpu_kv_copy._copy_rows(kl, src, torch.arange(di.numel()), self.c_buffers(), di, 1)
            return
        for buf, r in zip(bufs, rows, strict=True):
            _put(buf, index.to(buf.device, torch.int64), r.to(buf.device))

    def _c_writes(self, index: torch.Tensor, rows: list[torch.Tensor]):
        """The C kernels' build when they take this write (CPU tensors of this pool's dtypes and row shapes,
        contiguous, one per destination row, destinations in range), else None (the torch path)."""
        if index.device.type != "cpu" or not index.numel():
            return None
        kl = _c_build(self)
        if kl is None:
            return None
        for buf, r in zip(self.buffers(), rows, strict=True):
            if (r.device.type != "cpu" or r.dtype != buf.dtype or r.shape[1:] != buf.shape[1:] or not r.is_contiguous()
                    or r.shape[0] != index.numel()):
                return None
        if int(index.min()) < 0 or int(index.max()) >= self.num_slots:
            raise IndexError(f"write_rows: rows must lie in [0, {self.num_slots})")
        return kl

    def buffers(self) -> list[torch.Tensor]:
        """Every tensor of the pool: K of each layer, V of each layer, then (8-bit pools) their scales."""
        return self.k_buffers + self.v_buffers + (self.k_scales or []) + (self.v_scales or [])

    def c_buffers(self) -> cpu_kv_copy.PoolBuffers:
        """K then V of every layer (and their scales) as the C copies take them, made once: the buffers are fixed."""
        if self._c_buffers is None:
            scales = None if self.k_scales is None else self.k_scales + self.v_scales
            self._c_buffers = cpu_kv_copy.pool_buffers(self.k_buffers + self.v_buffers, scales)
        return self._c_buffers

    @property
    def format(self) -> torch.dtype:
        """What a row holds: the code dtype of an 8-bit pool, else the model dtype."""
        return self.code_dtype or self.dtype


class HostKVPool(KVPool):
    """Tier 1 of the hierarchical cache: the device pool's layout in host memory (pinned when the device pool is on
    CUDA, so copies either way go by DMA), in the device pool's format or in the compact 8-bit format (`code_dtype`
    over a model-dtype device pool: rows are quantized when they come down and dequantized when they go back up,
    kernels.kv_quant's reference arithmetic, about twice the tokens per byte). Row 0 is never handed out, as in
    the device pool. Untouched pages cost nothing on the CPU (zeros_untouched)."""

    def __init__(self, num_layers: int, num_rows: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
                 code_dtype: torch.dtype | None = None, pin: bool = False) -> None:
        # never in huge pages: written at scattered rows (demotes, disk reads), read only by copies (zeros_untouched)
        super().__init__(num_layers, num_rows, num_kv_heads, head_dim, dtype, "cpu", code_dtype)
        if pin:  # page-locked: host <-> device copies without a bounce buffer
            for group in (self.k_buffers, self.v_buffers, self.k_scales or [], self.v_scales or []):
                group[:] = [t.pin_memory() for t in group]


def host_tier_pool(cfg, pool: KVPool) -> HostKVPool | None:
    """The host tier of the hierarchical cache for a RuntimeConfig (None when it is off): --hicache-size GB, else
    --hicache-ratio times the device pool's tokens, in cfg.hicache_code_dtype's format."""
    if not cfg.hicache_enabled:
        return None
    layers, heads, dim = len(pool.k_buffers), pool.k_buffers[0].shape[1], pool.k_buffers[0].shape[2]
    code = cfg.hicache_code_dtype
    if cfg.hicache_size > 0:
        rows = int(cfg.hicache_size * 2**30) // KVPool.bytes_per_slot(layers, heads, dim, pool.dtype, code)
    else:
        rows = int(cfg.hicache_ratio * (pool.num_slots - 1))
    if rows < 1:
        raise ValueError(f"the hierarchical cache's host tier would hold {rows} tokens: raise --hicache-ratio or "
                         f"--hicache-size")
    pin = pool.k_buffers[0].device.type == "cuda"
    return HostKVPool(layers, rows + 1, heads, dim, pool.dtype, code, pin=pin)


@contextlib.contextmanager
def one_thread():
    """Run small row copies on this thread alone (the main thread's; others are left as they are): each is a few
    hundred KB per layer, where waking the intra-op pool costs more than the copy, and far more when the cores are
    busy (measured 50x on two loaded cores)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(n)


def copy_kv_rows(src: KVPool, src_index: torch.Tensor, dst: KVPool, dst_index: torch.Tensor) -> None:
    """dst rows dst_index = src rows src_index, every layer's K and V, converting between the pools' formats: the
    same format is a bit copy (codes and scales of an 8-bit pool too); model dtype -> 8-bit quantizes each (token,
    head) row (kv_quant.quantize_kv_ref), 8-bit -> model dtype dequantizes (code * scale in float32, rounded to
    the model dtype). Converting between two different code dtypes is refused. Destination rows are distinct.

    Two CPU pools go through the C kernels (kernels.cpu_kv_copy: every buffer in one call, the same bits), on this
    thread alone up to C_COPY_ROWS_ALONE rows; other pools (CUDA) through torch ops, a few per buffer."""
    src.refuse_windowed("copy_kv_rows")
    dst.refuse_windowed("copy_kv_rows")
    if src_index.numel() != dst_index.numel():
        raise ValueError(f"copy_kv_rows: {src_index.numel()} source rows for {dst_index.numel()} destination rows")
    if src.format != dst.format and src.code_dtype is not None and dst.code_dtype is not None:
        raise ValueError(f"copy_kv_rows: no conversion from {src.code_dtype} codes to {dst.code_dtype} codes")
    if len(src.k_buffers) != len(dst.k_buffers) or src.k_buffers[0].shape[1:] != dst.k_buffers[0].shape[1:]:
        raise ValueError("copy_kv_rows: the pools differ in layers, KV heads or head_dim")
    if not src_index.numel():
        return
    kl = _c_copies(src, dst)
    if kl is None:
        with one_thread():
            _copy_kv_rows(src, src_index, dst, dst_index)
        return
    si, di = src_index.to("cpu", torch.int64).contiguous(), dst_index.to("cpu", torch.int64).contiguous()
    for name, idx, pool in (("source", si, src), ("destination", di, dst)):
        if int(idx.min()) < 0 or int(idx.max()) >= pool.num_slots:
            raise IndexError(f"copy_kv_rows: {name} rows must lie in [0, {pool.num_slots})")
    threads = 1 if si.numel() <= C_COPY_ROWS_ALONE else min(2, torch.get_num_threads())
    cpu_kv_copy._copy_rows(kl, src.c_buffers(), si, dst.c_buffers(), di, threads)


# Rows up to which a C copy runs on the calling thread alone, above which on 2 threads. Measured for SmolLM2-135M's
# pools (benchmarks/bench_kv_copy.py): 2 threads halve 256 to 2048 rows on idle cores, but with the other core busy
# they cost ~6 ms at any size up to 2048 rows (the second thread waits for a time slice) against 0.1 to 14 ms alone.
C_COPY_ROWS_ALONE = 4096


def _c_copies(src: KVPool, dst: KVPool):
    """The C kernels' build when they take this copy (two CPU pools of supported formats), else None."""
    if dst.k_buffers[0].device.type != "cpu":
        return None
    model = src.dtype if src.code_dtype is None else dst.dtype
    return _c_build(src) if model in cpu_kv_copy.VALUE_DTYPES else None


def _c_build(pool: KVPool):
    """The C kernels' build when they can copy this pool's rows (a CPU pool, head_dim within the kernels'), else
    None."""
    if pool.k_buffers[0].device.type != "cpu":
        return None
    kl = cpu.lib()
    return kl if kl is not None and pool.k_buffers[0].shape[2] <= kl.d_max else None


def _copy_kv_rows(src: KVPool, src_index: torch.Tensor, dst: KVPool, dst_index: torch.Tensor) -> None:
    """The torch path of copy_kv_rows (and its reference): a few ops per buffer."""
    s_dev, d_dev = src.k_buffers[0].device, dst.k_buffers[0].device
    si, di = src_index.to(s_dev, torch.int64), dst_index.to(d_dev, torch.int64)
    if src.format == dst.format:
        for s, d in zip(src.buffers(), dst.buffers(), strict=True):
            _put(d, di, _gather(s, si).to(d_dev, non_blocking=d_dev.type == "cuda"))
        return
    layers = range(len(src.k_buffers))
    for group in ("k", "v"):
        s_bufs, d_bufs = getattr(src, f"{group}_buffers"), getattr(dst, f"{group}_buffers")
        for i in layers:
            if dst.code_dtype is not None:  # quantize: model dtype -> codes and scales
                codes, scales = quantize_kv_ref(s_bufs[i].index_select(0, si), dst.code_dtype)
                _put(d_bufs[i], di, codes.to(d_dev))
                getattr(dst, f"{group}_scales")[i].index_copy_(0, di, scales.to(d_dev))
            else:  # dequantize: codes and scales -> model dtype
                values = dequantize_kv_ref(gather_codes(s_bufs[i], si),
                                           getattr(src, f"{group}_scales")[i].index_select(0, si), dst.dtype)
                d_bufs[i].index_copy_(0, di, values.to(d_dev))


def _gather(buf: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    return code_bits(buf).index_select(0, index).view(buf.dtype)


def _put(buf: torch.Tensor, index: torch.Tensor, rows: torch.Tensor) -> None:
    code_bits(buf).index_copy_(0, index, code_bits(rows))


def _element_size(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


class SlotAllocator:
    """Free KV slots. Slot 0 is never handed out (it pads gathers), so capacity is num_slots - 1."""

    def __init__(self, num_slots: int, device: str | torch.device = "cpu") -> None:
        self.capacity = num_slots - 1
        self.device = device
        self._free = torch.arange(1, num_slots, dtype=torch.int64, device=device)

    def available(self) -> int:
        return int(self._free.numel())

    def can_allocate(self, n: int) -> bool:
        return n <= self._free.numel()

    def allocate(self, n: int) -> torch.Tensor:
        if n > self._free.numel():
            raise RuntimeError(f"KV pool exhausted: asked for {n} slots, {self._free.numel()} free")
        out, self._free = self._free[:n], self._free[n:]
        return out

    def free(self, slots: torch.Tensor) -> None:
        if slots.numel():
            self._free = torch.cat([self._free, slots.to(self._free.device, torch.int64)])

    def reset(self) -> None:
        self._free = torch.arange(1, self.capacity + 1, dtype=torch.int64, device=self.device)


def new_req_to_slot_table(max_reqs: int, max_context: int, device: str | torch.device = "cpu") -> torch.Tensor:
    """The request->slot table tensor: (max_reqs + 1, max_context) int64, zeros. Row `max_reqs` is the padding row
    (see ReqToSlotTable); the model runner reads the tensor, the KV cache manager writes it."""
    return torch.zeros((max_reqs + 1, max_context), dtype=torch.int64, device=device)


class TableWrites(NamedTuple):
    """Writes to a request->slot table as segments: segment i puts slots[offset_i : offset_i + lengths[i]] (the
    offsets being the running sum of lengths) at row rows[i], columns from starts[i]. All int64."""

    rows: torch.Tensor  # (U,)
    starts: torch.Tensor  # (U,)
    lengths: torch.Tensor  # (U,)
    slots: torch.Tensor  # (sum of lengths,)

    def apply(self, table: torch.Tensor) -> None:
        """Make the same writes to another copy of the table (a rank of a parallel group)."""
        if not self.slots.numel():
            return
        seg_start = torch.cumsum(self.lengths, 0) - self.lengths  # each segment's first index into slots
        within = torch.arange(self.slots.numel()) - seg_start.repeat_interleave(self.lengths)
        cols = self.starts.repeat_interleave(self.lengths) + within
        table[self.rows.repeat_interleave(self.lengths).to(table.device), cols.to(table.device)] = \
            self.slots.to(table.device)


class TableWriteLog:
    """The writes made to the request->slot table since the last `take`: with tensor or pipeline parallelism
    the other ranks keep their own copy of the table, and rank 0 sends them these with each step (only what
    changed, so a step's message stays small)."""

    def __init__(self) -> None:
        self._parts: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]] = []

    def record(self, table: torch.Tensor, row: int, start: int, slots: torch.Tensor) -> None:
        """Before `table[row, start:start + len(slots)] = slots`: log the span between the first and the last
        entry it changes (rewriting a row with the slots it holds, as caching a prefix does, logs nothing)."""
        changed = (table[row, start:start + slots.numel()] != slots.to(table.device)).nonzero()
        if changed.numel():
            first, last = int(changed[0]), int(changed[-1])
            one = torch.ones(1, dtype=torch.int64)
            self._parts.append((one * row, one * (start + first), one * (last + 1 - first),
                                slots[first:last + 1].to("cpu", torch.int64)))

    def record_cells(self, rows: torch.Tensor, cols: torch.Tensor, slots: torch.Tensor) -> None:
        """`table[rows, cols] = slots`, one slot per (row, column)."""
        self._parts.append((rows.cpu(), cols.cpu(), torch.ones_like(rows, device="cpu"), slots.to("cpu", torch.int64)))

    def take(self) -> TableWrites:
        parts, self._parts = self._parts, []
        if not parts:
            empty = torch.zeros(0, dtype=torch.int64)
            return TableWrites(empty, empty, empty, empty)
        return TableWrites(*(torch.cat(column) for column in zip(*parts, strict=True)))


class ReqToSlotTable:
    """Row r, column j: the slot holding token position j of the request that owns row r.

    Wraps a tensor made by `new_req_to_slot_table`. Rows [0, max_reqs) are handed out; the last row,
    `padding_row`, never is: all its entries stay 0 (the padding slot), so a padded batch row (CUDA graph
    buckets) can point at it and read only slot 0. With a `log`, every write is also recorded there.
    """

    def __init__(self, table: torch.Tensor, log: TableWriteLog | None = None) -> None:
        if table.dim() != 2 or table.dtype != torch.int64 or table.shape[0] < 2:
            raise ValueError(f"the request->slot table must be a 2-D int64 tensor with >= 2 rows, "
                             f"got {tuple(table.shape)} {table.dtype}")
        self.table = table
        self.log = log
        self.max_reqs = table.shape[0] - 1
        self.padding_row = self.max_reqs
        self._free_rows = list(range(self.max_reqs - 1, -1, -1))

    def available(self) -> int:
        return len(self._free_rows)

    def allocate(self) -> int:
        if not self._free_rows:
            raise RuntimeError("no free request rows in the request->slot table")
        return self._free_rows.pop()

    def free(self, row: int) -> None:
        self._free_rows.append(row)

    def write(self, row: int, start: int, slots: torch.Tensor) -> None:
        # [start, start + len(slots)) of the request's positions
        if self.log is not None:
            self.log.record(self.table, row, start, slots)
        self.table[row, start:start + slots.numel()] = slots

    def write_cells(self, rows: torch.Tensor, cols: torch.Tensor, slots: torch.Tensor) -> None:
        """table[rows[i], cols[i]] = slots[i] (one new position of each of several requests)."""
        if self.log is not None:
            self.log.record_cells(rows, cols, slots)
        self.table[rows.to(slots.device), cols.to(slots.device)] = slots

    def read(self, row: int, start: int, end: int) -> torch.Tensor:
        """A copy of the slots of positions [start, end) of `row`."""
        return self.table[row, start:end].clone()
