"""Triton kernels, each beside a plain-torch reference with the same signature: `<name>_ref`, and for the
in-place kernels (trailing underscore) `<name>_ref_`, e.g. rotary_embedding_ / rotary_embedding_ref_.

Importing this package needs only torch: triton is imported on the first kernel launch, so the references
work without it. Kernels need CUDA tensors, or CPU tensors with TRITON_INTERPRET=1 set before that launch.
"""

from .attention import decode_attention, decode_attention_ref, extend_attention, extend_attention_ref
from .fused_moe import fused_moe, fused_moe_ref
from .lora import lora_expand_, lora_expand_ref_, lora_shrink, lora_shrink_ref
from .norm import AddNormResult, fused_add_rmsnorm, fused_add_rmsnorm_ref
from .quant_matmul import (
    awq_matmul,
    awq_matmul_ref,
    fp8_matmul,
    fp8_matmul_ref,
    gptq_matmul,
    gptq_matmul_ref,
    int8_matmul,
    int8_matmul_ref,
)
from .rotary import rotary_embedding_, rotary_embedding_ref_
from .store_kv import store_kv, store_kv_ref


def triton_available() -> bool:
    """Whether triton imports (this imports it); it says nothing about a GPU being present."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


__all__ = [
    "AddNormResult",
    "awq_matmul",
    "awq_matmul_ref",
    "fp8_matmul",
    "fp8_matmul_ref",
    "gptq_matmul",
    "gptq_matmul_ref",
    "int8_matmul",
    "int8_matmul_ref",
    "decode_attention",
    "decode_attention_ref",
    "extend_attention",
    "extend_attention_ref",
    "fused_add_rmsnorm",
    "fused_add_rmsnorm_ref",
    "fused_moe",
    "fused_moe_ref",
    "lora_expand_",
    "lora_expand_ref_",
    "lora_shrink",
    "lora_shrink_ref",
    "rotary_embedding_",
    "rotary_embedding_ref_",
    "store_kv",
    "store_kv_ref",
    "triton_available",
]
