"""The deterministic mode on CUDA (`device='cuda'`): what the Triton path covers, and its refusals.

There the ops set is TritonOps(deterministic=True) (layers/ops.py): decode attention sums every context over fixed
pieces of kernels.cpu.FIXED_PIECE positions merged in order, a prefill's every token runs as the decode query at
its own position (so chunking and cache hits cannot move its bits), every linear layer runs a fixed-tile Triton
matmul (dense weights: kernels.batch_invariant.fixed_matmul in place of cuBLAS, whose tiles and split follow the
row count; int8 / fp8 / AWQ / GPTQ: the dequantizing matmul with one row tile), and the sampler's reductions run
one program per row (executor/sampler_rows.BatchInvariantRows). RMSNorm (one program per row, its block from the
width), rotary, SiLU and the KV store need no variant. Those kernels' identity was checked under the Triton
interpreter (tests/kernels/test_deterministic_triton.py); benchmarks/gpu_check.sh runs the same tests on a GPU.

Refused at start, by name: what no test holds yet on this path (`CUDA_REFUSED`, read by runtime/deterministic.py's
check_config for a CUDA device), and per layer a matmul without a batch-invariant variant or an expert block
(layers/ops.batch_invariant).
"""

from __future__ import annotations

CUDA_REFUSED = (
    (lambda c: not c.disable_cuda_graph, "device={device} and CUDA graphs: the captured decode steps are not "
     "covered by the mode's tests yet; add disable_cuda_graph=True (--disable-cuda-graph)"),
    (lambda c: c.tp_size > 1 or c.pp_size > 1, "device={device} at tp_size={tp_size}, pp_size={pp_size}: the "
     "ranks' NCCL reductions sum in an order of their own; use tp_size=1 and pp_size=1"),
    (lambda c: c.ep_size > 1, "device={device} at ep_size={ep_size}: expert blocks have no batch-invariant "
     "kernel on CUDA"),
    (lambda c: c.enable_lora or bool(c.lora_paths), "device={device} and LoRA adapters: the Triton shrink / "
     "expand kernels' tiles follow the adapters' segments in the batch"),
    (lambda c: c.speculative_algorithm != "none", "device={device} and speculative_algorithm="
     "{speculative_algorithm}: verification on CUDA is not covered by the mode's tests"),
    (lambda c: c.hicache_enabled and c.hicache_kv_format in ("int8", "fp8_e4m3"),
     "hicache_kv_format={hicache_kv_format}: a prefix reloaded from the host or disk tier in 8-bit codes rounds "
     "apart from the one computed; use hicache_kv_format 'auto' or 'model'"),
)


def is_cuda(cfg) -> bool:
    return str(cfg.device).startswith("cuda")
