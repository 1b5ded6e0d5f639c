"""Expert blocks on the CPU (csrc/cpu_moe.h): E experts' weights packed per expert in a layout of
radixgen.kernels.cpu_linear (`PackedExperts`: bf16 K pairs, int8, int4), the grouped expert forward that reads
only the routed experts' weights, every expert's rows in one matmul (`moe_experts`), the routing (`moe_route`),
and the block as the fused decode step reads it (`MoEStepLayer`).

References: `moe_experts_ref` (the experts' math in torch on the unpacked weights, as
radixgen.runtime.layers.moe.experts_forward computes it) and `moe_route_ref` (softmax / top-k as the reference
models route).
"""

from __future__ import annotations

import ctypes

import torch
import torch.nn.functional as F

from ._checks import check_tensor, expect
from ._cpu_bindings import CKernels, MoELayerBF16, WeightDesc
from .cpu_linear import SUFFIX, PackedWeight, check_packed, unpack


class PackedExperts:
    """E experts' (n, k) weights, each a PackedWeight of one kind, and the array of their descriptors the C
    kernels take (kept alive here, as are the weights' data)."""

    def __init__(self, weights: list[PackedWeight]) -> None:
        expect(len(weights) > 0, "no experts")
        for w in weights:
            check_packed(w, True)
        first = weights[0]
        expect(all((w.kind, w.n, w.k, w.group) == (first.kind, first.n, first.k, first.group) for w in weights),
               "the experts' packed weights must be of one kind and shape")
        self.weights, self.n, self.k = weights, first.n, first.k
        self.descs = (WeightDesc * len(weights))()
        self.refresh()

    def refresh(self) -> None:
        """Copy the descriptors again (after cpu_linear.gather moved the weights' data)."""
        for i, w in enumerate(self.weights):
            self.descs[i] = w.desc

    def __len__(self) -> int:
        return len(self.weights)

    @property
    def address(self) -> int:
        return ctypes.addressof(self.descs)

    @property
    def nbytes(self) -> int:
        return sum(w.nbytes for w in self.weights)


def _check_experts(x, topk_weights, topk_ids, gate_up: PackedExperts, down: PackedExperts) -> None:
    check_tensor("x", x, 2, tuple(SUFFIX))
    expect(x.is_cpu, f"x must be a CPU tensor, got {x.device}")
    t, h = x.shape
    check_tensor("topk_ids", topk_ids, 2, (torch.int32,))
    check_tensor("topk_weights", topk_weights, 2, (torch.float32,))
    expect(topk_ids.shape[0] == t and topk_weights.shape == topk_ids.shape,
           f"topk_ids {tuple(topk_ids.shape)} and topk_weights {tuple(topk_weights.shape)} must be ({t}, k)")
    expect(len(gate_up) == len(down), "gate_up and down must hold the same experts")
    expect(gate_up.k == h and down.n == h and gate_up.n == 2 * down.k,
           f"experts of gate_up ({gate_up.n}, {gate_up.k}) and down ({down.n}, {down.k}) do not fit x's {h} columns")


def moe_experts(x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor, gate_up: PackedExperts,
                down: PackedExperts, first_expert: int = 0, *, kl: CKernels | None = None) -> torch.Tensor:
    """(T, H) = sum_j topk_weights[t, j] * down_e(silu(gate_e(x_t)) * up_e(x_t)), e = topk_ids[t, j], over the
    experts [first_expert, first_expert + E) these hold (others add zero); x float32 or bf16, ids int32,
    weights float32, both (T, k)."""
    from .cpu import _require

    _check_experts(x, topk_weights, topk_ids, gate_up, down)
    return _moe_experts(_require(kl), x.contiguous(), topk_weights.contiguous(), topk_ids.contiguous(), gate_up,
                        down, first_expert)


def _moe_experts(kl: CKernels, x, topk_weights, topk_ids, gate_up: PackedExperts, down: PackedExperts,
                 first_expert: int) -> torch.Tensor:
    out = torch.empty_like(x)
    kl.fn("moe_experts", SUFFIX[x.dtype])(
        gate_up=gate_up.descs, down=down.descs, n_local=len(gate_up), first=first_expert, x=x.data_ptr(),
        n_tok=x.shape[0], H=x.shape[1], I=down.k, ids=topk_ids.data_ptr(), weights=topk_weights.data_ptr(),
        k=topk_ids.shape[1], out=out.data_ptr())
    return out


def moe_experts_ref(x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor, gate_up: PackedExperts,
                    down: PackedExperts, first_expert: int = 0) -> torch.Tensor:
    """The reference of `moe_experts`: each (token, j) term in torch on the unpacked weights, rounded as the kernel
    (matmul outputs and the gated SiLU in x's dtype, the weighted terms summed over j in float32)."""
    t, k = topk_ids.shape
    out = torch.zeros(t, x.shape[1], dtype=torch.float32)
    for j in range(k):
        term = torch.zeros(t, x.shape[1], dtype=torch.float32)
        for e in range(len(gate_up)):
            rows = (topk_ids[:, j].long() == e + first_expert).nonzero().squeeze(-1)
            if rows.numel() == 0:
                continue
            gate, up = F.linear(x[rows].float(), unpack(gate_up.weights[e])).to(x.dtype).chunk(2, dim=-1)
            a = F.silu(gate) * up
            y = F.linear(a.float(), unpack(down.weights[e])).to(x.dtype)
            term[rows] = y.float() * topk_weights[rows, j:j + 1]
        out = term if j == 0 else out + term
    return out.to(x.dtype)


def moe_route(logits: torch.Tensor, top_k: int, softmax_before_topk: bool = True, norm_topk_prob: bool = False,
              *, kl: CKernels | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(T, E) logits (any float dtype, routed in float32) -> (weights (T, k) float32, ids (T, k) int32)."""
    from .cpu import _require

    check_tensor("logits", logits, 2, (torch.float32, torch.bfloat16, torch.float16))
    t, e = logits.shape
    expect(1 <= top_k <= e, f"top_k must lie in [1, {e}], got {top_k}")
    lf = logits.float().contiguous()
    ids = torch.empty((t, top_k), dtype=torch.int32)
    w = torch.empty((t, top_k), dtype=torch.float32)
    _require(kl).fn("rg_moe_route")(logits=lf.data_ptr(), n_tok=t, E=e, k=top_k,
                                     softmax_before_topk=int(softmax_before_topk), norm_topk_prob=int(norm_topk_prob),
                                     ids=ids.data_ptr(), weights=w.data_ptr())
    return w, ids


def moe_route_ref(logits: torch.Tensor, top_k: int, softmax_before_topk: bool = True,
                  norm_topk_prob: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    lf = logits.float()
    if softmax_before_topk:
        w, ids = torch.topk(torch.softmax(lf, -1), top_k, -1)
        if norm_topk_prob:
            w = w / w.sum(-1, keepdim=True)
    else:
        top, ids = torch.topk(lf, top_k, -1)
        w = torch.softmax(top, -1)
    return w, ids.to(torch.int32)


class MoEStepLayer:
    """One expert block for the fused decode step (a csrc rg_moe_layer): the router (E, H) as bf16 K pairs, this
    rank's experts, the shared expert's two packed weights and its gate (H,) bf16 (Qwen2-MoE) or None. The step's
    scratch is set by `set_scratch` (DecodeStepWeights does, for each step's row count)."""

    def __init__(self, router: PackedWeight, gate_up: PackedExperts, down: PackedExperts, *, num_experts: int,
                 top_k: int, first_expert: int, softmax_before_topk: bool, norm_topk_prob: bool,
                 shared: tuple[PackedWeight, PackedWeight] | None = None,
                 shared_gate: torch.Tensor | None = None) -> None:
        h = gate_up.k
        expect(router.kind != 0 and (router.n, router.k) == (num_experts, h),
               f"router: expected a ({num_experts}, {h}) matmul weight, got {router!r}")
        expect(len(gate_up) == len(down) and gate_up.n == 2 * down.k and down.n == h,
               "gate_up (E, 2I, H) and down (E, H, I) must be one block's")
        expect(down.k % 16 == 0 and (shared is None or shared[1].k % 16 == 0),
               f"the fused step's expert block needs intermediate sizes that are multiples of 16, got {down.k}"
               f"{'' if shared is None else f' and {shared[1].k}'}")
        expect(1 <= top_k <= num_experts and 0 <= first_expert and first_expert + len(gate_up) <= num_experts,
               f"top_k {top_k}, experts [{first_expert}, {first_expert + len(gate_up)}) of {num_experts}")
        s = self.struct = MoELayerBF16(gate_up=gate_up.address, down=down.address, n_local=len(gate_up),
                                       first=first_expert, I=down.k, num_experts=num_experts, top_k=top_k,
                                       softmax_before_topk=int(softmax_before_topk),
                                       norm_topk_prob=int(norm_topk_prob), router=router.desc)
        self.intermediate = down.k
        if shared is not None:
            sgu, sdown = shared
            expect(sgu.k == h and sdown.n == h and sgu.n == 2 * sdown.k, "the shared expert's gate_up and down")
            s.shared_gate_up, s.shared_down, s.shared_I = sgu.desc, sdown.desc, sdown.k
            self.intermediate = max(self.intermediate, sdown.k)
            if shared_gate is not None:
                expect(shared_gate.dtype == torch.bfloat16 and shared_gate.is_contiguous()
                       and shared_gate.numel() == h, f"shared_gate: a contiguous bf16 ({h},) vector")
                s.shared_gate = shared_gate.data_ptr()
        self.keep = (router, gate_up, down, shared, shared_gate)
        self.hidden, self.num_experts, self.top_k, self.n_local = h, num_experts, top_k, len(gate_up)

    @property
    def address(self) -> int:
        return ctypes.addressof(self.struct)

    def scratch_bytes(self, kl: CKernels, m: int) -> tuple[int, int]:
        """(shared, per-thread) scratch bytes of a step of m rows."""
        per_thread = ctypes.c_int64()
        shared = kl.fn("rg_moe_step_bytes")(M=m, H=self.hidden, E=self.num_experts, k=self.top_k, n_local=self.n_local,
                                           I=self.struct.I, sI=self.struct.shared_I,
                                           thread_bytes=ctypes.addressof(per_thread))
        return int(shared), int(per_thread.value)

    def set_scratch(self, shared: torch.Tensor, per_thread: torch.Tensor, thread_bytes: int) -> None:
        self.struct.scratch, self.struct.thread_scratch = shared.data_ptr(), per_thread.data_ptr()
        self.struct.thread_bytes = thread_bytes
