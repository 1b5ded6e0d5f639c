"""Rank 0 -> the other ranks of a tensor / pipeline parallel group: one `StepDescription` per step, as tensors.

A step carries the ForwardInput, the request->slot table writes since the previous step (the other ranks keep a
copy of the table) and the KV copy orders every rank applies to its own part of the pool before the step's
forward (`KVCopies`): pool slots -> pool slots, and between the pool and the hierarchical cache's host tier (a node
moving down on eviction, or loaded back before a request's prefill), the host side named by its row indices.

`ForwardInput` (one step's tensors, what the model runner takes) is declared here too: the scheduler's Batch builds
it and every rank runs it. messages.py keeps the Engine <-> scheduler records.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import IntEnum
from typing import ClassVar, NamedTuple

import torch

from radixgen.runtime.ground.kv_pool import HostKVPool, KVPool, TableWrites, copy_kv_rows


class ForwardInput(NamedTuple):
    """One step's tensors. Requests' new tokens are concatenated in request order."""

    input_ids: torch.Tensor  # (T,)
    positions: torch.Tensor  # (T,)
    out_slots: torch.Tensor  # (T,) where each new token's K/V is written
    req_indices: torch.Tensor  # (B,) rows of the request->slot table
    prefix_lens: list[int]  # (B,) tokens already in the pool
    extend_lens: list[int]  # (B,) new tokens this step
    logit_rows: torch.Tensor  # (N,) which of the T hidden rows to turn into logits
    # a verification of draft tokens: each request's new tokens are its last token and its drafts, consecutive
    # positions, logits at every row (the fused CPU step takes these: cpu_decode.FusedDecode.applies)
    verify: bool = False
    lora_slots: list[int] | None = None  # (B,) each request's LoRA pool slot (-1: base model); None: no adapter
    # (B,) each request's media items (common.prompt.MediaItem, spans in prompt positions; () for a text request),
    # when some request of the step has media (decode steps too: a model's positions may depend on them); else None
    media: tuple | None = None

    @property
    def is_decode(self) -> bool:
        return all(e == 1 for e in self.extend_lens)


class StepKind(IntEnum):
    FORWARD = 0  # apply the copy orders, then run `forward_input`
    HEARTBEAT = 1  # nothing to run: rank 0 is idle and alive (the others' waits stay within the group timeout)
    SHUTDOWN = 2  # pass it on and exit


class CopyDirection(IntEnum):
    DEVICE_TO_DEVICE = 0  # pool slots `src` -> pool slots `dst`, every layer's K and V (and 8-bit scales)
    DEVICE_TO_HOST = 1  # pool slots `src` -> host tier rows `dst` (converted to the host tier's format)
    HOST_TO_DEVICE = 2  # host tier rows `src` -> pool slots `dst`


class KVCopies(NamedTuple):
    """KV copy orders as segments: order i copies src[offset_i : offset_i + lengths[i]] to the same range of `dst`
    (the offsets being the running sum of lengths) in direction directions[i]. All int64."""

    directions: torch.Tensor  # (C,)
    lengths: torch.Tensor  # (C,)
    src: torch.Tensor  # (sum of lengths,)
    dst: torch.Tensor  # (sum of lengths,)

    @classmethod
    def empty(cls) -> KVCopies:
        none = torch.zeros(0, dtype=torch.int64)
        return cls(none, none, none, none)

    def __bool__(self) -> bool:
        return bool(self.directions.numel())

    def apply(self, pool: KVPool, host: HostKVPool | None = None) -> None:
        """Run the orders on this rank's pool (and host tier), in order (a later order may read what an earlier one
        wrote)."""
        starts = (torch.cumsum(self.lengths, 0) - self.lengths).tolist()
        for direction, start, n in zip(self.directions.tolist(), starts, self.lengths.tolist(), strict=True):
            if direction not in tuple(CopyDirection):
                raise ValueError(f"KV copy direction {direction} is not implemented")
            src, dst = self.src[start:start + n], self.dst[start:start + n]
            if direction != CopyDirection.DEVICE_TO_DEVICE:
                if host is None:
                    raise ValueError(f"KV copy {CopyDirection(direction).name}: this rank has no host tier")
                a, b = (pool, host) if direction == CopyDirection.DEVICE_TO_HOST else (host, pool)
                copy_kv_rows(a, src, b, dst)
                continue
            buffers = pool.k_buffers + pool.v_buffers + (pool.k_scales or []) + (pool.v_scales or [])
            for buf in buffers:
                s, d = src.to(buf.device), dst.to(buf.device)
                buf[d] = buf[s]  # index_select then index_put: overlapping src and dst read the old rows


class KVCopyQueue:
    """The copy orders given since the last `take` (rank 0: the KV cache manager gives them, the step takes them)."""

    def __init__(self) -> None:
        self._parts: list[tuple[int, torch.Tensor, torch.Tensor]] = []

    def copy_slots(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Order pool slots `src` copied to slots `dst` (same length) before the next step's forward."""
        if src.dim() != 1 or src.shape != dst.shape:
            raise ValueError(f"copy_slots: src and dst must be 1-D of the same length, got {tuple(src.shape)} and "
                             f"{tuple(dst.shape)}")
        self.order(CopyDirection.DEVICE_TO_DEVICE, src, dst)

    def order(self, direction: CopyDirection, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Order rows `src` copied to rows `dst` (same length) in `direction` before the next step's forward."""
        if src.dim() != 1 or src.shape != dst.shape:
            raise ValueError(f"KV copy: src and dst must be 1-D of the same length, got {tuple(src.shape)} and "
                             f"{tuple(dst.shape)}")
        if src.numel():
            self._parts.append((int(direction), src.to("cpu", torch.int64), dst.to("cpu", torch.int64)))

    def __len__(self) -> int:
        return len(self._parts)

    def take(self) -> KVCopies:
        parts, self._parts = self._parts, []
        if not parts:
            return KVCopies.empty()
        return KVCopies(torch.tensor([d for d, _, _ in parts], dtype=torch.int64),
                        torch.tensor([s.numel() for _, s, _ in parts], dtype=torch.int64),
                        torch.cat([s for _, s, _ in parts]), torch.cat([d for _, _, d in parts]))


@dataclass
class StepDescription:
    """One step of a tensor / pipeline parallel group, as rank 0 (the scheduler) sends it to the other ranks
    (runtime/executor/parallel_step.py): the step's ForwardInput, the request->slot table writes made since the previous
    step, which the other ranks apply to their copy of the table, and the KV copy orders. On the wire: a header of
    HEADER_LEN int64 (the kind and the lengths), then one int64 payload with every tensor and list concatenated."""

    kind: StepKind
    forward_input: ForwardInput | None = None
    table_writes: TableWrites | None = None
    kv_copies: KVCopies | None = None

    # kind, tokens T, requests B, logit rows N, table segments U, table slots S, verify, copy orders C, copied K
    HEADER_LEN: ClassVar[int] = 9

    def pack(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self.kind != StepKind.FORWARD:
            header = torch.zeros(self.HEADER_LEN, dtype=torch.int64)
            header[0] = int(self.kind)
            return header, torch.zeros(0, dtype=torch.int64)
        fi, tw = self.forward_input, self.table_writes
        kc = self.kv_copies if self.kv_copies is not None else KVCopies.empty()
        lens = torch.tensor([*fi.prefix_lens, *fi.extend_lens], dtype=torch.int64)
        parts = [fi.input_ids, fi.positions, fi.out_slots, fi.req_indices, lens, fi.logit_rows, *tw, *kc]
        header = torch.tensor([int(self.kind), fi.input_ids.numel(), fi.req_indices.numel(), fi.logit_rows.numel(),
                               tw.rows.numel(), tw.slots.numel(), int(fi.verify), kc.directions.numel(),
                               kc.src.numel()], dtype=torch.int64)
        return header, torch.cat([p.to("cpu", torch.int64).reshape(-1) for p in parts])

    @staticmethod
    def payload_len(header: torch.Tensor) -> int:
        _, t, b, n, u, s, _, c, k = header.tolist()
        return 3 * t + 3 * b + n + 3 * u + s + 2 * c + 2 * k

    @classmethod
    def unpack(cls, header: torch.Tensor, payload: torch.Tensor) -> StepDescription:
        kind, t, b, n, u, s, verify, c, k = header.tolist()
        if kind != StepKind.FORWARD:
            return cls(StepKind(kind))
        # [ids T | positions T | out_slots T | req_indices B | prefix_lens B | extend_lens B | logit_rows N |
        #  table rows U | starts U | lengths U | slots S | copy directions C | copy lengths C | src K | dst K]
        ids, pos, slots, rows, prefix, extend, logit_rows, t_rows, t_starts, t_lens, t_slots, c_dir, c_len, c_src, \
            c_dst = payload.split([t, t, t, b, b, b, n, u, u, u, s, c, c, k, k])
        fi = ForwardInput(ids, pos, slots, rows, prefix.tolist(), extend.tolist(), logit_rows, verify=bool(verify))
        return cls(StepKind.FORWARD, fi, TableWrites(t_rows, t_starts, t_lens, t_slots),
                   KVCopies(c_dir, c_len, c_src, c_dst))
