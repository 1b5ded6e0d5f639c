"""Shared builders for the kernel tests: device choice, error metric, a shuffled KV pool, a LoRA batch."""

from __future__ import annotations

from typing import NamedTuple

import torch

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
TOL = {torch.float32: 1e-3, torch.bfloat16: 1e-2, torch.float16: 1e-2}


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """||out - ref|| / ||ref||, NaN-aware: any NaN or inf in out gives inf."""
    out, ref = out.double(), ref.double()
    if not torch.isfinite(out).all():
        return float("inf")
    return ((out - ref).norm() / ref.norm()).item()


class Pool(NamedTuple):
    k_buffer: torch.Tensor  # (num_slots, Hkv, D)
    v_buffer: torch.Tensor
    req_to_slot: torch.Tensor  # (max_reqs, max_context_len)
    req_indices: torch.Tensor  # (B,) rows of req_to_slot, shuffled


def make_pool(lens: list[int], num_kv_heads: int, head_dim: int, dtype: torch.dtype, *,
              max_reqs: int = 6, max_context_len: int = 96, index_dtype: torch.dtype = torch.int64,
              gen: torch.Generator) -> Pool:
    """A pool with random K/V whose request b holds lens[b] tokens in randomly permuted slots (never slot 0),
    in a random table row. Table entries past a request's length point at other requests' slots, so a kernel
    reading past the length gets a wrong answer rather than a lucky one."""
    total = sum(lens)
    num_slots = total + 9  # a few never-used slots besides the padding slot 0
    shape = (num_slots, num_kv_heads, head_dim)
    k_buffer = torch.randn(shape, generator=gen).to(dtype)
    v_buffer = torch.randn(shape, generator=gen).to(dtype)
    slots = torch.randperm(num_slots - 1, generator=gen)[:total] + 1
    req_to_slot = torch.randint(1, num_slots, (max_reqs, max_context_len), generator=gen)
    rows = torch.randperm(max_reqs, generator=gen)[: len(lens)]
    start = 0
    for row, n in zip(rows.tolist(), lens, strict=True):
        req_to_slot[row, :n] = slots[start:start + n]
        start += n
    return Pool(k_buffer.to(DEVICE), v_buffer.to(DEVICE), req_to_slot.to(index_dtype).to(DEVICE),
                rows.to(index_dtype).to(DEVICE))


def lens_tensor(values: list[int], dtype: torch.dtype = torch.int64) -> torch.Tensor:
    return torch.tensor(values, dtype=dtype, device=DEVICE)


CODE_DTYPES = [torch.int8, torch.float8_e4m3fn]


class QuantizedPool(NamedTuple):
    pool: Pool  # the table and rows; its buffers hold the values the codes were made from
    k_codes: torch.Tensor  # (num_slots, Hkv, D) int8 / float8_e4m3fn
    v_codes: torch.Tensor
    k_scales: torch.Tensor  # (num_slots, Hkv) bfloat16
    v_scales: torch.Tensor

    def scales(self) -> dict:
        return {"k_scales": self.k_scales, "v_scales": self.v_scales}


def quantize_pool(pool: Pool, code_dtype: torch.dtype) -> QuantizedPool:
    """make_pool's pool as an 8-bit pool (kv_quant's reference quantization of every slot)."""
    from radixgen.kernels.kv_quant import quantize_kv_ref

    (kc, ks), (vc, vs) = (quantize_kv_ref(b.cpu(), code_dtype) for b in (pool.k_buffer, pool.v_buffer))
    return QuantizedPool(pool, kc.to(DEVICE), vc.to(DEVICE), ks.to(DEVICE), vs.to(DEVICE))


class LoRACase(NamedTuple):
    """A merged projection's LoRA delta over a batch of three adapters (radixgen.kernels.lora's layout): rows of
    each adapter scattered through the batch, a slot of rank 0 (no weights), ranks below the pool's, segments of
    q | k | v sizes that are no multiple of 16."""

    x: torch.Tensor  # (T, K)
    y: torch.Tensor  # (T, N) the matmul's output the deltas are added to
    a: torch.Tensor  # (S, 3 R / 16, K/2, 16, 2)
    b: torch.Tensor  # (S, N/16, R/2, 16, 2)
    scales: torch.Tensor
    ranks: torch.Tensor  # (S,) int32
    segments: list[tuple[int, int]]
    rows: torch.Tensor
    seg_starts: torch.Tensor
    seg_lens: torch.Tensor
    seg_slots: torch.Tensor

    @property
    def max_len(self) -> int:
        return int(self.seg_lens.max())

    def args(self, y: torch.Tensor) -> tuple:
        """cpu_lora.lora_delta_'s arguments, adding into y."""
        return (y, self.x, self.a, self.b, self.scales, self.ranks, self.segments, self.rows, self.seg_starts,
                self.seg_lens, self.seg_slots)

    def reference(self) -> torch.Tensor:
        from radixgen.kernels import lora_expand_ref_, lora_shrink_ref

        seg = (self.rows, self.seg_starts, self.seg_lens, self.seg_slots, self.max_len)
        y = self.y.clone()
        h = lora_shrink_ref(self.x, self.a, *seg)
        r = 2 * self.b.shape[2]
        for g, (c0, c1) in enumerate(self.segments):
            lora_expand_ref_(y, h, self.b, self.scales, *seg, c0, c1, g * r)
        return y


def lora_case(gen: torch.Generator, dtype: torch.dtype = torch.bfloat16, t: int = 37, k: int = 72,
              r: int = 16) -> LoRACase:
    s_ = 4
    segments = [(0, 40), (40, 63), (63, 86)]
    n = segments[-1][1]
    ranks = torch.tensor([16, 6, 0, 12], dtype=torch.int32)
    a = torch.randn(s_, 3 * r, k, generator=gen)
    b = torch.randn(s_, r, n, generator=gen) / r**0.5
    for slot, rank in enumerate(ranks.tolist()):  # a slot's ranks past its own are zero, as the pool keeps them
        a[slot].view(3, r, k)[:, rank:] = 0
        b[slot, rank:] = 0
    from radixgen.kernels.lora import pack_kpairs

    a = torch.stack([pack_kpairs(a[slot]) for slot in range(s_)])
    b = torch.stack([pack_kpairs(b[slot].t()) for slot in range(s_)])
    slot_of = torch.randint(0, s_, (t,), generator=gen)
    slot_of[::5] = -1  # base-model rows, in no segment
    rows, starts, lens, slots = [], [], [], []
    for slot in (3, 0, 2, 1):
        mine = [i for i in range(t) if int(slot_of[i]) == slot]
        if mine:
            starts.append(len(rows))
            lens.append(len(mine))
            slots.append(slot)
            rows += mine
    return LoRACase(torch.randn(t, k, generator=gen).to(dtype), (4 * torch.randn(t, n, generator=gen)).to(dtype),
                    a.to(dtype), b.to(dtype), torch.rand(s_, generator=gen) + 0.5, ranks, segments,
                    *(torch.tensor(v, dtype=torch.int64) for v in (rows, starts, lens, slots)))
