"""The fused bf16 decode step of csrc/cpu_kernels.c (CPUs with AVX512-BF16): every decoder layer of a small
decode batch in one C call (see radixgen.runtime.executor.cpu_decode), its matmuls on the layers' own packed weights
(radixgen.kernels.cpu_linear: bf16 K pairs, int8 or int4), and the LM head on those weights for a prefill's few
sampled rows. On a rank of a tensor / pipeline parallel group the same call runs that rank's part (`StageIO`,
`TensorParallelHook`; csrc/cpu_parallel.h)."""

from __future__ import annotations

import ctypes
from collections.abc import Callable
from typing import NamedTuple

import torch

from . import cpu_linear
from ._checks import check_tensor, expect
from ._cpu_bindings import (
    ALL_REDUCE_FN,
    LORA_MATMULS,
    LORA_MAX_ROWS,
    CKernels,
    LayerBF16,
    LoRALayerBF16,
    LoRAStepBF16,
    ParallelBF16,
)
from .cpu import _ptr, context_split
from .cpu_linear import KIND_ROWS, PackedWeight
from .kv_quant import SCALE_DTYPE

# a pool's element dtype -> csrc/cpu_kv_quant.h's KV_PLAIN, KV_INT8, KV_FP8 (the layer's kv_format)
KV_FORMAT = {torch.bfloat16: 0, torch.int8: 1, torch.float8_e4m3fn: 2}

STAGE_IDS, STAGE_EMBEDDED, STAGE_HIDDEN = 0, 1, 2  # rg_parallel.input (csrc/cpu_parallel.h)


class TensorParallelHook:
    """The all-reduce the fused step calls after each row-parallel matmul (attention output, MLP down): `reduce`
    sums a bf16 tensor over the tensor-parallel ranks in place (torch.distributed in the runtime). C calls
    back into Python from one thread of its team; an exception there cannot cross the C frames, so it is kept,
    later calls of the step return at once, and `decode_step` raises it when the C call has returned.

    The deterministic mode's hook has `sum_partials` instead ((M, hidden) float32 partial sums, x) -> None: the
    row-parallel matmuls (`partial` weights) write their unrounded sums into `partials` (float32, kept per row
    count), which it gathers and adds in rank order into x (layers/fixed_order.py)."""

    def __init__(self, reduce: Callable[[torch.Tensor], object] | None,
                 sum_partials: Callable[[torch.Tensor, torch.Tensor], object] | None = None) -> None:
        self.reduce, self.sum_partials = reduce, sum_partials
        self.target: torch.Tensor | None = None  # the step's x buffer, the only one C passes
        self.partials: torch.Tensor | None = None
        self.error: BaseException | None = None
        self.callback = ALL_REDUCE_FN(self._on_reduce)  # kept alive as long as the hook

    def partials_for(self, x: torch.Tensor) -> torch.Tensor:
        """The float32 buffer of x's shape the step's partial sums go to."""
        if self.partials is None or self.partials.shape != x.shape:
            self.partials = torch.empty(x.shape, dtype=torch.float32)
        return self.partials

    def _on_reduce(self, ctx, ptr, n) -> None:
        if self.error is not None:
            return
        try:
            t = self.target
            if t is None or t.data_ptr() != ptr or t.numel() != n:
                raise RuntimeError("the fused step asked for an all-reduce of a buffer it was not given")
            if self.sum_partials is not None:
                self.sum_partials(self.partials, t)
            else:
                self.reduce(t)
        except BaseException as e:  # noqa: BLE001 - raised by decode_step once C has returned
            self.error = e

    def take_error(self) -> BaseException | None:
        error, self.error = self.error, None
        return error


class StageIO(NamedTuple):
    """How a rank's step starts and ends (defaults: the whole model on one rank). embedded: the (M, hidden)
    embedded rows (a vocabulary-parallel embedding, already summed) instead of embed's rows for ids; hidden /
    residual: a previous pipeline stage's output and residual stream; final=False: stop after the last
    layer and return (hidden, residual) for the next stage; hook: the tensor-parallel all-reduce."""

    embedded: torch.Tensor | None = None
    hidden: torch.Tensor | None = None
    residual: torch.Tensor | None = None
    final: bool = True
    hook: TensorParallelHook | None = None

    @property
    def plain(self) -> bool:
        return self.embedded is None and self.hidden is None and self.final and self.hook is None


class DecodeStepWeights:
    """The weights of a Llama-family decoder stack as `decode_step` reads them: norm weights (optionally per-head
    q/k norms, Qwen3) and the qkv bias as given (bf16), the four matmul weights (or, for an expert block, a
    cpu_moe.MoEStepLayer "moe" in place of gate_up and down; `intermediate` is then the widest activation), the LM
    head (vocab, hidden) and the embedding table (vocab rows of hidden; the LM head's own weight when they are tied)
    as PackedWeights (by descriptor, not copied), the KV buffers (bf16, or an 8-bit pool's codes and scales) by
    address. All of them must stay alive and in place as long as this object is used (the model's layers and pool
    hold them). A pipeline stage before the last has no final norm (None); a rank whose step starts from embedded
    rows or a previous stage's output has no embedding table (None)."""

    MATMULS = ("qkv", "o", "gate_up", "down")

    def __init__(self, kl: CKernels, layers: list[dict], final_norm: torch.Tensor | None, *, num_heads: int,
                 num_kv_heads: int, head_dim: int, intermediate: int, eps: float, embed: PackedWeight | None,
                 lm_head: PackedWeight | None = None) -> None:
        expect(kl.has_decode_step, "this CPU build has no fused decode step (needs AVX512-BF16)")
        expect(len(layers) > 0, "the fused step needs at least one layer")
        hidden = layers[0]["input_norm"].shape[0]
        qkv_n = (num_heads + 2 * num_kv_heads) * head_dim
        expect(num_heads % num_kv_heads == 0, "num_heads must be a multiple of num_kv_heads")
        vectors = {"input_norm": hidden, "qkv_bias": qkv_n, "post_norm": hidden, "q_norm": head_dim,
                   "k_norm": head_dim}
        matmuls = {"qkv": (qkv_n, hidden), "o": (hidden, num_heads * head_dim), "gate_up": (2 * intermediate, hidden),
                   "down": (hidden, intermediate)}
        optional = ("qkv_bias", "q_norm", "k_norm")
        arr = (LayerBF16 * len(layers))()
        for i, ly in enumerate(layers):
            for name, n in vectors.items():
                t = ly.get(name)
                if t is None and name in optional:
                    continue
                expect(t is not None and tuple(t.shape) == (n,) and t.dtype == torch.bfloat16 and t.is_contiguous()
                       and t.is_cpu, f"layer {i} {name}: expected a contiguous CPU bfloat16 tensor of shape ({n},)")
                setattr(arr[i], name, t.data_ptr())
            moe = ly.get("moe")  # a cpu_moe.MoEStepLayer in place of the gated MLP, or None
            for name, shape in matmuls.items():
                if name in ("gate_up", "down"):
                    if moe is not None:
                        continue
                    li = ly["down"].k if isinstance(ly.get("down"), PackedWeight) else intermediate
                    li = li if 0 < li <= intermediate else intermediate  # the layer's own width, at most the step's
                    shape = (2 * li, hidden) if name == "gate_up" else (hidden, li)
                _check_packed(f"layer {i} {name}", ly.get(name), shape)
                setattr(arr[i], name, ly[name].desc)
            if moe is not None:
                expect(moe.hidden == hidden and moe.intermediate <= intermediate,
                       f"layer {i}'s expert block: hidden {moe.hidden}, intermediate {moe.intermediate}")
                arr[i].moe = moe.address
            self._set_pool(arr[i], i, ly, num_kv_heads, head_dim)
            arr[i].lora = ly.get("lora")  # a LoRAStepWeights.address, or None
        if embed is not None:
            _check_packed("embed", embed, (embed.n if isinstance(embed, PackedWeight) else 0, hidden), rows=True)
        self.vocab = 0
        if lm_head is not None:
            _check_packed("lm_head", lm_head, (lm_head.n if isinstance(lm_head, PackedWeight) else 0, hidden))
            self.vocab = lm_head.n
        self.layers, self.final_norm, self.embed, self.lm_head = arr, final_norm, embed, lm_head
        self.keep = (layers, final_norm)
        self.hidden, self.num_heads, self.num_kv_heads, self.head_dim = hidden, num_heads, num_kv_heads, head_dim
        self.intermediate, self.eps = intermediate, float(eps)
        self.moe = [ly["moe"] for ly in layers if ly.get("moe") is not None]
        self._moe_scratch: dict[tuple[int, int], tuple] = {}
        self._moe_key: tuple[int, int] | None = None
        self._scratch: dict[tuple[int, int], tuple] = {}
        self._thread_scratch = torch.empty(0, dtype=torch.uint8)

    @staticmethod
    def _set_pool(layer: LayerBF16, i: int, ly: dict, num_kv_heads: int, head_dim: int) -> None:
        """The layer's KV pool: bf16 buffers, or 8-bit codes with their scales ("k_scale", "v_scale")."""
        code = ly["k_buf"].dtype
        for name in ("k_buf", "v_buf"):
            t = ly[name]
            expect(t.dtype == code and t.dtype in KV_FORMAT and t.is_contiguous()
                   and t.shape[1:] == (num_kv_heads, head_dim),
                   f"layer {i} {name}: expected a contiguous (slots, {num_kv_heads}, {head_dim}) pool of bfloat16 "
                   f"or 8-bit codes")
            setattr(layer, name, t.data_ptr())
        layer.kv_format = KV_FORMAT[code]
        if code == torch.bfloat16:
            return
        for name in ("k_scale", "v_scale"):
            t = ly.get(name)
            expect(t is not None and t.dtype == SCALE_DTYPE and t.is_contiguous()
                   and tuple(t.shape) == tuple(ly["k_buf"].shape[:2]),
                   f"layer {i} {name}: an 8-bit pool needs its contiguous bfloat16 (slots, {num_kv_heads}) scales")
            setattr(layer, name, t.data_ptr())

    def scratch(self, m: int, splits: int) -> tuple:
        """decode_step's buffers for m rows: (x, out, res_a, res_b, qkv, attn, gu, part, logits), kept from one
        step to the next (a step's outputs are valid until the next step with as many rows)."""
        key = (m, splits)
        if key not in self._scratch:
            bf, h, hkv, d = torch.bfloat16, self.num_heads, self.num_kv_heads, self.head_dim
            if len(self._scratch) >= 8:
                self._scratch.clear()
            self._scratch[key] = (
                *(torch.empty((m, self.hidden), dtype=bf) for _ in range(4)),
                torch.empty((m, (h + 2 * hkv) * d), dtype=bf), torch.empty((m, h * d), dtype=bf),
                torch.empty((m, 2 * self.intermediate), dtype=bf),
                torch.empty(m * hkv * splits * (h // hkv) * (d + 2), dtype=torch.float32),
                None if self.lm_head is None else torch.empty((m, self.vocab), dtype=torch.float32))
        return self._scratch[key]

    def set_moe_scratch(self, kl: CKernels, m: int, threads: int) -> None:
        """Point the expert blocks at their scratch for m rows and `threads` threads (one set for all: the layers
        run one after another), kept from one step to the next."""
        key = (m, threads)
        if not self.moe or key == self._moe_key:
            return
        if key not in self._moe_scratch:
            if len(self._moe_scratch) >= 8:
                self._moe_scratch.clear()
            sizes = [b.scratch_bytes(kl, m) for b in self.moe]
            shared, per_thread = max(s for s, _ in sizes), max(t for _, t in sizes)
            self._moe_scratch[key] = (torch.empty(shared, dtype=torch.uint8),
                                      torch.empty(per_thread * threads, dtype=torch.uint8), per_thread)
        shared, mine, per_thread = self._moe_scratch[key]
        for b in self.moe:
            b.set_scratch(shared, mine, per_thread)
        self._moe_key = key

    def thread_scratch(self, nbytes: int) -> torch.Tensor:
        """decode_step's per-thread scratch, at least `nbytes`: kept and grown (doubling) as contexts get longer,
        so that steps allocate nothing."""
        if self._thread_scratch.numel() < nbytes:
            self._thread_scratch = torch.empty(max(nbytes, 2 * self._thread_scratch.numel()), dtype=torch.uint8)
        return self._thread_scratch


def _check_packed(what: str, pw, shape: tuple[int, int], rows: bool = False) -> None:
    expect(isinstance(pw, PackedWeight) and (pw.n, pw.k) == shape and (rows or pw.kind != KIND_ROWS),
           f"{what}: expected a {'' if rows else 'matmul '}PackedWeight of shape {shape}, got {pw!r}")

class LoRAStepWeights:
    """A LoRA pool as the fused step reads it (csrc/cpu_lora.h): one descriptor per layer holding the addresses of
    the pool's stacked buffers (which must stay alive and in place), and the step's rows grouped by adapter slot,
    rewritten by `set_rows` before each step. layers[l][mat] (mat: qkv, o, gate_up, down) is (a (S, nseg R / 16,
    K/2, 16, 2), b (S, N/16, R/2, 16, 2)) bf16 (kernels/lora.py's K-pair blocks), or None where the pool holds no
    weights for it;
    scales (S,) float32; ranks (L, S, 4) int32, each slot's rank per layer and matmul (0: no delta)."""

    def __init__(self, layers: list[list[tuple[torch.Tensor, torch.Tensor] | None]], scales: torch.Tensor,
                 ranks: torch.Tensor, max_rank: int) -> None:
        expect(scales.dtype == torch.float32 and scales.is_contiguous(), "scales: expected contiguous float32")
        expect(ranks.dtype == torch.int32 and ranks.is_contiguous() and ranks.shape == (len(layers), scales.shape[0],
               LORA_MATMULS), f"ranks: expected contiguous int32 ({len(layers)}, {scales.shape[0]}, {LORA_MATMULS})")
        self.step = LoRAStepBF16()
        h_stride = -(-3 * max_rank // 16) * 16  # q | k | v: the widest shrink, in whole blocks of 16
        self.h = torch.empty(LORA_MAX_ROWS * h_stride, dtype=torch.bfloat16)
        self.step.h, self.step.h_stride = self.h.data_ptr(), h_stride
        self.layers = []
        for i, mats in enumerate(layers):
            d = LoRALayerBF16(step=ctypes.pointer(self.step), scales=scales.data_ptr(), ranks=ranks[i].data_ptr(),
                              max_rank=max_rank)
            for j, ab in enumerate(mats):
                if ab is None:
                    continue
                a, b = ab
                expect(all(t.dtype == torch.bfloat16 and t.is_contiguous() and t.is_cpu for t in ab)
                       and a.dim() == 5 and b.dim() == 5 and a.shape[0] == b.shape[0] == scales.shape[0]
                       and 2 * b.shape[2] == max_rank and a.shape[3:] == b.shape[3:] == (16, 2),
                       f"layer {i} matmul {j}: expected contiguous bf16 a (S, nseg {max_rank} / 16, K/2, 16, 2), "
                       f"b (S, N/16, {max_rank // 2}, 16, 2)")
                d.a[j], d.b[j] = a.data_ptr(), b.data_ptr()
            self.layers.append(d)
        self.keep = (layers, scales, ranks)

    def address(self, layer: int) -> int:
        return ctypes.addressof(self.layers[layer])

    def set_rows(self, row_slots: list[int] | None) -> None:
        """The step's rows: row i has adapter slot row_slots[i] (-1: the base model); None: no row has one."""
        groups: dict[int, list[int]] = {}
        for i, slot in enumerate(row_slots or ()):
            if slot >= 0:
                groups.setdefault(slot, []).append(i)
        st, pos = self.step, 0
        for g, (slot, rows) in enumerate(groups.items()):
            st.slot[g], st.start[g], st.len[g] = slot, pos, len(rows)
            for r in rows:
                st.rows[pos] = r
                pos += 1
        st.n_groups = len(groups)


def decode_step(kl: CKernels, w: DecodeStepWeights, ids: torch.Tensor, positions: torch.Tensor,
                cos_sin_cache: torch.Tensor, out_slots: torch.Tensor, req_to_slot: torch.Tensor,
                req_indices: torch.Tensor, max_len: int, scale: float,
                io: StageIO = StageIO(), requests: int | None = None,
                piece: int = 0) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Every decoder layer and the final norm for a decode batch of M tokens `ids` at `positions` (each request's
    context being its position + 1, this token included), from their rows of `w.embed` (as bf16) ->
    ((M, hidden) final hidden states, (M, vocab) float32 logits, rounded to bf16, or None where `w` has no LM
    head), both in `w`'s buffers for M rows, valid until its next step with M rows. max_len: the longest
    context. Index tensors int64 and contiguous, no checks: the runtime builds them. Writes this step's K/V
    into the pool at out_slots. Rows of one request (consecutive positions, the same entry in req_indices, which
    has one entry per row) see each other's K/V: all rows' K/V are stored before any row attends. `requests`
    (default M): how many requests the rows belong to, which sets how each context is split for attention;
    piece > 0: fixed pieces of that many positions instead (cpu.context_split, the deterministic mode).
    With `io`, one rank's part of a parallel group (StageIO): w.embed may then be None, and a stage that is not
    final returns ((M, hidden) output, (M, hidden) residual stream) instead, also in `w`'s buffers."""
    expect(w.embed is not None or io.embedded is not None or io.hidden is not None,
           "a step from token ids needs the decode-step weights' embedding table")
    m = ids.shape[0]
    h, hkv, d = w.num_heads, w.num_kv_heads, w.head_dim
    threads = torch.get_num_threads()
    splits, piece = context_split(m if requests is None else requests, max_len, threads, piece)
    x, out, res_a, res_b, qkv, attn, gu, part, logits = w.scratch(m, splits)
    # the kernel checks the scratch against the contexts it reads (RG_ERR_SCRATCH if max_len was too small)
    nbytes = kl.fn("rg_decode_step_scratch_bytes_bf16")(M=m, hidden=w.hidden, H=h, Hkv=hkv, D=d, inter=w.intermediate,
                                                        max_piece=piece or -(-max_len // splits), threads=threads)
    scratch = w.thread_scratch(nbytes)
    par = None if io.plain else _parallel(io, x, res_a)
    w.set_moe_scratch(kl, m, threads)
    kl.fn("rg_decode_step_bf16")(
        layers=w.layers, n_layers=len(w.layers), final_norm=_ptr(w.final_norm),
        lm_head=None if w.lm_head is None else w.lm_head.ref, logits=_ptr(logits),
        embed=None if w.embed is None else w.embed.ref, ids=ids.data_ptr(), M=m, hidden=w.hidden, H=h, Hkv=hkv, D=d,
        inter=w.intermediate, eps=w.eps, scale=scale, positions=positions.data_ptr(),
        cos_sin=cos_sin_cache.data_ptr(), out_slots=out_slots.data_ptr(), table=req_to_slot.data_ptr(),
        table_stride=req_to_slot.stride(0), rows=req_indices.data_ptr(), splits=splits, piece=piece,
        x=x.data_ptr(), out=out.data_ptr(), res_a=res_a.data_ptr(), res_b=res_b.data_ptr(), qkv=qkv.data_ptr(),
        attn=attn.data_ptr(), gu=gu.data_ptr(), part=part.data_ptr(), scratch=scratch.data_ptr(),
        scratch_bytes=scratch.numel(), threads=threads, par=None if par is None else ctypes.addressof(par))
    error = io.hook.take_error() if io.hook is not None else None
    if error is not None:
        raise error
    return (out, logits) if io.final else (x, res_a)


def _parallel(io: StageIO, x: torch.Tensor, res_a: torch.Tensor) -> ParallelBF16:
    """The rg_parallel of one step: the inputs copied into the step's buffers, the hook pointed at x."""
    mode = STAGE_IDS
    if io.hidden is not None:
        expect(io.residual is not None and io.embedded is None, "a stage input is a hidden and a residual")
        x.copy_(io.hidden)
        res_a.copy_(io.residual)
        mode = STAGE_HIDDEN
    elif io.embedded is not None:
        x.copy_(io.embedded)
        mode = STAGE_EMBEDDED
    par = ParallelBF16(input=mode, output=0 if io.final else 1)
    if io.hook is not None:
        io.hook.target = x
        par.all_reduce = io.hook.callback
        if io.hook.sum_partials is not None:
            par.partials = io.hook.partials_for(x).data_ptr()
    return par


def lm_head_logits(kl: CKernels, w: DecodeStepWeights, hidden: torch.Tensor) -> torch.Tensor:
    """(M, hidden) bf16 final hidden states -> (M, vocab) float32 logits (rounded to bf16, as the fused step's)
    on `w`'s LM head, which it must have."""
    expect(w.lm_head is not None, "these decode-step weights have no LM head")
    check_tensor("hidden", hidden, 2, (torch.bfloat16,))
    expect(hidden.shape[1] == w.hidden, f"hidden: expected {w.hidden} columns, got {hidden.shape[1]}")
    return cpu_linear._linear(kl, w.lm_head, hidden.contiguous(), None, float_out=True)
