"""The paged KV pool: per-layer K/V buffers indexed by slot, a free-slot allocator, the request->slot table.

The model runner holds the buffers and the table tensor; the KV cache manager (scheduler/kv_manager.py) owns
the allocator and the table's rows.

A request's tokens may live in any slots: attention reads and writes KV only through slot indices,
which is what lets the radix tree share a prefix's slots between requests.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from radixgen.kernels.kv_quant import SCALE_DTYPE


def zeros_untouched(shape: tuple[int, ...], dtype: torch.dtype, device: str | torch.device) -> torch.Tensor:
    """A zero tensor whose host pages are not touched until written.

    On the CPU, torch.zeros writes every byte, so a 2 GiB pool is resident from the start; numpy's zeros takes
    fresh zero pages from the kernel (calloc), so the process's resident memory grows with the KV actually used."""
    if torch.device(device).type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    import numpy as np

    nbytes = torch.Size(shape).numel() * _element_size(dtype)
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
    quantized once when it is stored (radixgen.kernels.kv_quant), and attention reads values in `dtype`."""

    def __init__(self, num_layers: int, num_slots: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: str | torch.device = "cpu", code_dtype: torch.dtype | None = None) -> None:
        self.num_slots = num_slots
        self.dtype, self.code_dtype = dtype, code_dtype
        shape = (num_slots, num_kv_heads, head_dim)
        self.k_buffers = [zeros_untouched(shape, code_dtype or dtype, device) for _ in range(num_layers)]
        self.v_buffers = [zeros_untouched(shape, code_dtype or dtype, device) for _ in range(num_layers)]
        self.k_scales = self.v_scales = None
        if code_dtype is not None:
            self.k_scales = [zeros_untouched(shape[:2], SCALE_DTYPE, device) for _ in range(num_layers)]
            self.v_scales = [zeros_untouched(shape[:2], SCALE_DTYPE, device) for _ in range(num_layers)]

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
