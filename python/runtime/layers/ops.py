"""The device's ops: one set chosen once at start (`ops_for`), installed on the model's layers, which call
`ops.rms_norm`, `ops.add_rms_norm`, `ops.rotary`, `ops.silu_and_mul`, `ops.lora_delta_` (LoRA layers);
attention goes through `ops.attention` (the backend the runner puts in each step's ForwardContext) and linear
layers through the method the ops set picks for the model's quantization (`prepare`, before the weights are
loaded: see layers/quantization).

- `TorchOps`: plain torch, any device. The reference the others are tested against (disable_cpu_kernels
  selects it for a whole model), and what their ops fall back to for a shape or stride they do not cover.
- `CpuOps`: radixgen.kernels.cpu's C kernels (where the build exists and the shape and strides fit), the CPU
  attention backend, C matmuls over packed weights (bf16 K pairs, int8, int4; oneDNN for float32).
- `TritonOps`: radixgen.kernels' Triton kernels; on CUDA, or on the CPU under TRITON_INTERPRET=1 (tests).
"""

from __future__ import annotations

import torch
from torch import nn

from radixgen.kernels import cpu as cpu_kernels
from radixgen.kernels import cpu_linear, cpu_lora, cpu_moe
from radixgen.runtime.layers.attention import CpuAttentionBackend, TorchAttentionBackend, TritonAttentionBackend
from radixgen.runtime.layers.linear import LinearBase
from radixgen.runtime.layers.quantization import NONE, QuantSpec, linear_method
from radixgen.runtime.layers.quantization.experts import GroupedLinear, grouped_method


class TorchOps:
    name = "torch"
    kernels: cpu_kernels.CKernels | None = None  # the C kernels the linear methods use (CpuOps)
    attention_piece = 0  # > 0: the deterministic mode's fixed pieces of decode attention (CpuOps)

    def __init__(self) -> None:
        self.attention = TorchAttentionBackend()
        self._rotary_lookup: tuple = (None, None, None, None)  # (positions, dtype, table, (cos, sin))

    def prepare(self, model: nn.Module, spec: QuantSpec = NONE) -> None:
        """Before `model`'s weights are loaded: give each linear layer this device's method for weight format
        `spec`, which makes the parameters the checkpoint fills."""
        for m in model.modules():
            if isinstance(m, LinearBase):
                m.set_linear_method(linear_method(self.name, spec, m, self.kernels))
            elif isinstance(m, GroupedLinear):  # an expert block's experts
                try:
                    m.method = grouped_method(spec.method, self.name, self.kernels, m)
                except ValueError as e:
                    raise ValueError(f"{type(model).__name__} has expert blocks: {e}") from e
                m.method.create_weights(m)

    def install(self, model: nn.Module) -> None:
        """Once `model`'s weights are loaded: the linear methods re-lay them out (one copy each), and this becomes
        the ops of every layer."""
        for m in model.modules():
            if isinstance(m, OpsLayer):
                m.ops = self
            if isinstance(m, (LinearBase, GroupedLinear)):
                m.process_weights()

    def linear_methods(self, model: nn.Module) -> list[str]:
        """The names of the linear methods `model`'s layers use."""
        return sorted({m.method.name for m in model.modules() if isinstance(m, LinearBase)})

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """RMSNorm over the last dim, computed in float32, rounded once to x's dtype."""
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
        return (weight.float() * xf).to(x.dtype) if weight.dtype != torch.float32 else (weight * xf).to(x.dtype)

    def add_rms_norm(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                     eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        """(rms_norm(x + residual), x + residual); the sum is rounded to the dtype before the norm."""
        residual = x + residual
        return self.rms_norm(residual, weight, eps), residual

    def rotary(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
               cos_sin_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotate-half rotary embedding of q (T, Hq, D), k (T, Hk, D) at `positions`; cos_sin_cache (P, D) float32
        holds cos in its first D/2 columns, sin in the rest. Returns the rotated q, k (in place or new)."""
        # every layer of a step passes the same positions tensor: look the table up once per step
        last_pos, last_dtype, last_table, cos_sin = self._rotary_lookup
        if positions is not last_pos or q.dtype != last_dtype or cos_sin_cache is not last_table:
            cos, sin = cos_sin_cache[positions].to(q.dtype).chunk(2, dim=-1)  # (T, D/2) each
            cos_sin = (cos.unsqueeze(1), sin.unsqueeze(1))
            self._rotary_lookup = (positions, q.dtype, cos_sin_cache, cos_sin)
        cos, sin = cos_sin
        return _rotate(q, cos, sin), _rotate(k, cos, sin)

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        """(..., 2N) gate|up -> (..., N) silu(gate) * up."""
        return cpu_kernels.silu_and_mul_ref(x)

    def lora_delta_(self, y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scales: torch.Tensor,
                    ranks: torch.Tensor, segments: list[tuple[int, int]], rows) -> None:
        """y (T, N) += the LoRA deltas of a merged projection with input x (T, K), in place: for each group
        (slot s, its rows, its scale) of `rows` (lora.pool.LoRARows) and each output segment g = [c0, c1),
        y[rows, c0:c1] += (x[rows] @ A_s^T)[:, g R : (g+1) R] @ B_s[:, c0:c1] * scale, each product rounded to
        the dtype. a (S, nseg R / 16, K/2, 16, 2), b (S, N/16, R/2, 16, 2) (K-pair blocks: lora/pool.py,
        kernels/lora.py); ranks (S,) int32 on the host, 0: slot s has no weights here."""
        from radixgen.kernels.lora import expand_weights, unpack_kpairs

        r = 2 * b.shape[2]
        held = ranks.tolist()
        mm = _row_by_row if self.attention_piece else torch.matmul  # the deterministic mode: one shape per row
        for slot, idx, scale in rows.groups:
            if held[slot] == 0:
                continue
            h = mm(x[idx], unpack_kpairs(a[slot]).t())  # (n, 16 ceil(nseg R / 16))
            for g, (c0, c1) in enumerate(segments):
                y[idx, c0:c1] += mm(h[:, g * r:(g + 1) * r], expand_weights(b, slot, c0, c1)) * scale


def _row_by_row(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """p @ q one row of p at a time: a row's bits do not depend on how many rows share the call (torch's matmul
    picks its blocking by the row count)."""
    return torch.cat([p[i:i + 1] @ q for i in range(p.shape[0])]) if p.shape[0] else p @ q


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


def _heads_contiguous(t: torch.Tensor, head_dim: int) -> bool:
    return t.stride(2) == 1 and t.stride(1) == head_dim


def gather_packed(model: nn.Module) -> None:
    """The C matmuls' packed weights of `model` moved into one arena (on huge pages) in module order, the order a
    decode step streams them (cpu_linear.gather); again after weights were laid out anew (experts.convert)."""
    packed, experts = [], []  # in module order; an expert block's experts (grouped C layout) among them
    for m in model.modules():
        p = getattr(m, "packed", None)
        if isinstance(m, LinearBase) and isinstance(p, cpu_linear.PackedWeight):
            packed.append(p)
        elif isinstance(p, cpu_moe.PackedExperts):
            packed += p.weights
            experts.append(p)
    cpu_linear.gather(packed)
    for e in experts:
        e.refresh()  # their descriptor arrays point at the moved weights


class CpuOps(TorchOps):
    """The C kernels of `kl` (None: no build, torch throughout) where they apply, else the torch op; linear layers
    on the C matmuls' packed layouts where the build has them, oneDNN-packed float weights otherwise."""

    name = "cpu"

    def __init__(self, kl: cpu_kernels.CKernels | None, deterministic: bool = False) -> None:
        """deterministic: every attention query over fixed pieces of its context (runtime/deterministic.py says
        what else the mode needs, and refuses it where the kernels cannot keep it)."""
        super().__init__()
        self.kl = self.kernels = kl
        self.attention_piece = cpu_kernels.FIXED_PIECE if deterministic else 0
        self.attention = CpuAttentionBackend(kl, self.attention_piece) if kl is not None else TorchAttentionBackend()

    def install(self, model: nn.Module) -> None:
        """As TorchOps.install; then the C matmuls' packed weights move into one arena in the order a decode step
        streams them (cpu_linear.gather)."""
        super().install(model)
        gather_packed(model)

    def _c_rows(self, x: torch.Tensor, weight: torch.Tensor) -> bool:
        """Whether the C RMSNorm takes x: (T, N) rows of unit stride, float32 or bfloat16, weight alike."""
        return (self.kl is not None and x.dim() == 2 and x.stride(1) == 1 and x.is_cpu
                and x.dtype in cpu_kernels.DTYPES and weight.dtype == x.dtype)

    def rms_norm(self, x, weight, eps):
        if self._c_rows(x, weight):
            return cpu_kernels._add_rmsnorm(self.kl, x, weight, eps, None)
        return super().rms_norm(x, weight, eps)

    def add_rms_norm(self, x, residual, weight, eps):
        if self._c_rows(x, weight) and residual.dtype == x.dtype:
            residual = residual.contiguous()  # one C call: the residual add happens in place on it
            return cpu_kernels._add_rmsnorm(self.kl, x, weight, eps, residual), residual
        return super().add_rms_norm(x, residual, weight, eps)

    def rotary(self, positions, q, k, cos_sin_cache):
        d = q.shape[2]
        if (self.kl is not None and q.is_cpu and q.dtype in cpu_kernels.DTYPES and k.dtype == q.dtype
                and positions.dtype == torch.int64 and positions.is_contiguous()
                and _heads_contiguous(q, d) and _heads_contiguous(k, d)):
            cpu_kernels._rotary(self.kl, positions, q, k, cos_sin_cache)
            return q, k
        return super().rotary(positions, q, k, cos_sin_cache)

    def silu_and_mul(self, x):
        # one C call for bf16 on AVX512-BF16 CPUs, the same bits as torch's
        if (self.kl is not None and self.kl.has_decode_step and x.dtype == torch.bfloat16 and x.dim() == 2
                and x.is_contiguous() and x.is_cpu):
            return cpu_kernels._silu_and_mul(self.kl, x)
        return super().silu_and_mul(x)

    def lora_delta_(self, y, x, a, b, scales, ranks, segments, rows):
        # one C call for bf16 on AVX512-BF16 CPUs: a few torch ops per adapter and segment cost more than the math
        if (self.kl is not None and self.kl.has_decode_step and y.dtype == torch.bfloat16 and x.dtype == y.dtype
                and x.is_contiguous() and y.is_contiguous() and y.is_cpu):
            t = rows.as_tensors(y.device)
            cpu_lora._lora_delta(self.kl, y, x, a, b, scales, ranks, rows.seg_end(segments), t["rows"],
                                    t["starts"], t["lens"], t["slots"])
            return
        super().lora_delta_(y, x, a, b, scales, ranks, segments, rows)


class TritonOps(TorchOps):
    """radixgen.kernels' Triton kernels: attention, fused add-RMSNorm over (T, N) rows, rotary in place; the
    SiLU and per-head norms stay torch ops."""

    name = "triton"

    def __init__(self) -> None:
        super().__init__()
        self.attention = TritonAttentionBackend()

    def rms_norm(self, x, weight, eps):
        if x.dim() == 2:
            from radixgen import kernels

            return kernels.fused_add_rmsnorm(x, weight, eps).out
        return super().rms_norm(x, weight, eps)

    def add_rms_norm(self, x, residual, weight, eps):
        if x.dim() == 2:
            from radixgen import kernels

            out, residual = kernels.fused_add_rmsnorm(x, weight, eps, residual)
            return out, residual
        return super().add_rms_norm(x, residual, weight, eps)

    def rotary(self, positions, q, k, cos_sin_cache):
        from radixgen import kernels

        kernels.rotary_embedding_(positions, q, k, cos_sin_cache, q.shape[2])
        return q, k

    def lora_delta_(self, y, x, a, b, scales, ranks, segments, rows):
        # one shrink for every segment (q | k | v at once), one expand per output segment; rank-0 slots add zeros
        from radixgen import kernels

        t = rows.as_tensors(y.device)
        seg = (t["rows"], t["starts"], t["lens"], t["slots"], t["max_len"])
        h = kernels.lora_shrink(x, a, *seg)
        r = 2 * b.shape[2]
        for g, (c0, c1) in enumerate(segments):
            kernels.lora_expand_(y, h, b, scales, *seg, c0, c1, g * r)


def ops_for(device: torch.device | str, disable_cpu_kernels: bool = False, deterministic: bool = False) -> TorchOps:
    """The ops set of a device, chosen once: Triton on CUDA; on the CPU the C kernels (when they build) unless
    disable_cpu_kernels asks for plain torch; deterministic: the C kernels' batch-invariant choices."""
    device = torch.device(device)
    if device.type == "cuda":
        return TritonOps()
    if device.type != "cpu" or disable_cpu_kernels:
        return TorchOps()
    return CpuOps(cpu_kernels.lib(), deterministic)


class OpsLayer(nn.Module):
    """A layer whose math goes through `self.ops`: plain torch until `ops.install(model)` sets the device's set."""

    ops: TorchOps = TorchOps()
