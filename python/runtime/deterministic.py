"""The deterministic mode (`RuntimeConfig.deterministic`, `--deterministic`): what it needs, and its refusals.

What it promises (docs/architecture.md, "The deterministic mode"): on the CPU path with bf16 or float32 activations,
on every build of the C kernels (AVX2, AVX-512 without BF16, AVX512-BF16), a request's output ids and logprobs are
the same bits whatever else is in its batches, however its prompt is chunked, whatever part of it comes from the
radix cache, with or without speculation, through the fused decode step or the layer-by-layer path, after a
retraction; for bf16 weights, float32 weights (layers/fixed_order.FixedFloat32: one FMA chain per output, the same
bits on every build), fp8 weights (stored as the bf16 weight their upcast path multiplies by), GGUF files from their
own blocks, int8 / int4 / AWQ / GPTQ weights, expert blocks (bf16, float32, int8 / int4 and GGUF experts, on every
build: layers/fixed_experts.py), LoRA adapters, 8-bit KV pools and the host / disk tiers (in the pool's format); at
any tp size (above 1: bf16 weights on an AVX512-BF16 build; tp 1 and 2 give each other's bits, a larger group its
own), pp 1 or 2, tp and pp together. The mode's choices are made once, when the
model is built: the ops set (`ops_for(..., deterministic=True)`) has decode attention sum every context over fixed
pieces (kernels.cpu.FIXED_PIECE) and every query of a prefill run as a decode query at its own position, so a
token's attention, and from it its K/V and hidden states, do not depend on the step that computed it. The bf16
K-pair matmuls give each output one accumulator fed the input pairs in order (vdpbf16ps, or float32 FMAs on AVX2),
and the GGUF K-quant kernels compute each output in a fixed order, so a row's dot products are the same at 1 row and
at 200 (tests/kernels/test_deterministic_builds_kernels.py holds them to it); the int8 / int4 matmuls, which run
another kernel past 16 rows, get calls of at most 16 rows, and GGUF Q4_0 / Q4_1 / Q8_0 ones, whose panel GEMM starts
at 9 rows, of at most 8 (layers/fixed_order.FixedRows). On AVX512-BF16 the row-parallel ones sum tp 2's cut of their
inputs as two fixed segments at tp 1 and tp 2 alike (layers/fixed_order.py), so that the two layouts round the same;
a larger group sums each rank's share as its own segment, in rank order. An expert sees however many rows the batch
routed to it: each expert's matmuls run on those kernels (bf16 experts off AVX512-BF16 builds one expert at a time
on the K-pair matmul, int8 / int4 ones in calls of at most 16 rows, GGUF stacks in calls of at most 8 where a
32-value kind has its panel GEMM), the router on the bf16 K pairs (or the float32 chains) instead of torch's matmul,
and a token's k weighted terms are added in float32 in rank order, so its result does not depend on who shares its
experts.

Everything the mode cannot keep is refused at start with the combination named, never served with a weaker
promise: this module's two checks, the config's (`check_config`, from RuntimeConfig) and the runner's, once the
weight format and the kernels are known (`check_deterministic`), and per layer, layers/fixed_order.install's.
On CUDA the Triton path's promise and refusals are runtime/deterministic_cuda.py's.
"""

from __future__ import annotations

import torch

# why each combination is refused: the sums it would leave to the batch, or what no test holds yet
_REFUSED = (
    (lambda c: c.device != "cpu", "device={device}: the mode runs on 'cpu' and 'cuda' (runtime/deterministic_cuda.py)"),
    (lambda c: c.ep_size > 1, "ep_size={ep_size}: the expert ranks' partial sums are all-reduced in no fixed order; "
     "use ep_size=1"),
    (lambda c: c.disable_cpu_kernels, "disable_cpu_kernels: the plain torch matmuls and attention pick their "
     "blocking by the row count"),
    (lambda c: c.hicache_enabled and c.kv_code_dtype is None and c.hicache_kv_format in ("int8", "fp8_e4m3"),
     "hicache_kv_format={hicache_kv_format} over a {dtype} pool: a prefix reloaded from the host or disk tier in "
     "8-bit codes rounds apart from the one computed; use hicache_kv_format 'auto' or 'model'"),
)


def check_config(cfg) -> None:
    """ValueError naming the first option `cfg` (a RuntimeConfig with deterministic=True) combines with
    deterministic mode that the mode cannot keep."""
    from radixgen.runtime.deterministic_cuda import CUDA_REFUSED, is_cuda

    for refused, why in CUDA_REFUSED if is_cuda(cfg) else _REFUSED:  # (CUDA: the Triton path's own list)
        if refused(cfg):
            raise ValueError("deterministic mode does not run with " + why.format(**vars(cfg)))


def check_deterministic(quant_spec, dtype: torch.dtype, ops, head_dim: int) -> None:
    """The runner's check, once the weight format (`quant_spec`, resolved from the checkpoint), the activations'
    dtype, the ops set and the head size are known: bf16 activations on radixgen's C kernels (any build), heads
    the C attention takes (else the torch attention would run, whose sums follow the batch). Each linear layer's
    method is checked once loaded (layers/fixed_order.install). The Triton ops set (CUDA) checks its layers itself
    (layers/ops.batch_invariant)."""
    if getattr(ops, "name", None) == "triton":
        return
    if dtype not in (torch.bfloat16, torch.float32):
        raise ValueError(f"deterministic mode needs bfloat16 or float32 activations on the CPU, got {dtype}")
    kl = getattr(ops, "kl", None)  # the C kernels of CpuOps; the other ops sets have none
    if kl is None or not ops.attention_piece:
        raise ValueError("deterministic mode needs radixgen's C kernels (they did not build here, or "
                         "RADIXGEN_DISABLE_CPU_KERNELS turned them off)")
    if head_dim > kl.d_max:
        raise ValueError(f"deterministic mode does not run with head_dim={head_dim}: the C attention kernels take "
                         f"heads of up to {kl.d_max}")
