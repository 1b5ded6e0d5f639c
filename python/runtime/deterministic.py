"""The deterministic mode (`RuntimeConfig.deterministic`, `--deterministic`): what it needs, and its refusals.

What it promises (docs/architecture.md, "The deterministic mode"): on the CPU path with bf16 weights, a request's
output ids and logprobs are the same bits whatever else is in its batches, however its prompt is chunked, whatever
part of it comes from the radix cache, with or without speculation, through the fused decode step or the
layer-by-layer path, after a retraction, and at tp 1 or 2, pp 1 or 2. The mode's choices are made once, when the
model is built: the ops set (`ops_for(..., deterministic=True)`) has decode attention sum every context over fixed
pieces (kernels.cpu.FIXED_PIECE) and every query of a prefill run as a decode query at its own position, so a
token's attention, and from it its K/V and hidden states, do not depend on the step that computed it. The bf16
matmuls give each output one vdpbf16ps accumulator fed the input pairs in order, so a row's dot products are the
same at 1 row and at 200 (tests/kernels/test_deterministic_kernels.py holds them to it), and whatever output rows
a tensor-parallel rank holds; the row-parallel ones sum tp 2's cut of their inputs as two fixed segments at tp 1
and tp 2 alike (layers/fixed_order.py), so that the two layouts round the same.

Everything the mode cannot keep is refused at start with the combination named, never served with a weaker
promise: this module's two checks, the config's (`check_config`, from RuntimeConfig) and the runner's, once the
weight format and the kernels are known (`check_deterministic`), and per layer, layers/fixed_order.install's.
"""

from __future__ import annotations

import torch

# why each combination is refused: the sums it would leave to the batch, or what no test holds yet
_REFUSED = (
    (lambda c: c.device != "cpu", "device={device}: the Triton kernels have no batch-invariant variant yet (their "
     "decode split follows the batch); use device='cpu'"),
    (lambda c: c.tp_size not in (1, 2), "tp_size={tp_size}: the row-parallel sums run in tp 2's fixed segments "
     "(layers/fixed_order.py), which a larger group would cut further; use tp_size 1 or 2"),
    (lambda c: c.tp_size > 1 and c.pp_size > 1, "tp_size={tp_size} and pp_size={pp_size} together: not covered by "
     "the mode's tests (each alone is); use one of them"),
    (lambda c: c.disable_cpu_kernels, "disable_cpu_kernels: the plain torch matmuls and attention pick their "
     "blocking by the row count"),
    (lambda c: c.lora_enabled, "LoRA adapters: the segmented LoRA deltas are not covered by the mode's tests"),
    (lambda c: c.dtype == "float32", "dtype=float32: float32 weights run on oneDNN, whose kernels follow the row "
     "count; use dtype='bfloat16'"),
    (lambda c: c.quantization not in ("auto", "none"), "quantization={quantization}: the int8 / int4 matmuls "
     "dequantize in registers up to 16 rows and to a bf16 panel beyond, which round apart; use bf16 weights"),
    (lambda c: c.kv_cache_dtype != "auto", "kv_cache_dtype={kv_cache_dtype}: 8-bit KV pools are not covered by the "
     "mode's tests; use kv_cache_dtype='auto'"),
)


def check_config(cfg) -> None:
    """ValueError naming the first option `cfg` (a RuntimeConfig with deterministic=True) combines with
    deterministic mode that the mode cannot keep."""
    for refused, why in _REFUSED:
        if refused(cfg):
            raise ValueError("deterministic mode does not run with " + why.format(**vars(cfg)))


def check_deterministic(quant_spec, dtype: torch.dtype, ops, head_dim: int) -> None:
    """The runner's check, once the weight format (`quant_spec`, resolved from the checkpoint), the activations'
    dtype, the ops set and the head size are known: bf16 dense weights on the C kernels of an AVX512-BF16 CPU,
    heads the C attention takes (else the torch attention would run, whose sums follow the batch)."""
    if quant_spec.method != "none":
        raise ValueError(f"deterministic mode does not run with quantized weights (the checkpoint resolves to "
                         f"{quant_spec.method}): the int8 / int4 matmuls round apart at up to 16 rows and beyond")
    if dtype != torch.bfloat16:
        raise ValueError(f"deterministic mode needs bfloat16 weights on the CPU, got {dtype} (dtype='auto' picks "
                         f"float32 on a CPU without AVX512-BF16 or AMX)")
    kl = getattr(ops, "kl", None)  # the C kernels of CpuOps; the other ops sets have none
    if kl is None or not kl.has_decode_step or not ops.attention_piece:
        raise ValueError("deterministic mode needs radixgen's C kernels built for AVX512-BF16 (this CPU or build "
                         "lacks them: the kernels did not build, or the CPU has no AVX512-BF16)")
    if head_dim > kl.d_max:
        raise ValueError(f"deterministic mode does not run with head_dim={head_dim}: the C attention kernels take "
                         f"heads of up to {kl.d_max}")
