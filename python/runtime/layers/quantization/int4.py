"""int4: weight-only, asymmetric, groups of 64 input columns (32 where the input size is no multiple of 64), an fp16
scale and offset per group (w = scale * q + offset, q in 0..15), quantized at load from a float checkpoint
(QuantizedWeight.int4_from). Every linear layer but the LM head (kept in the model's dtype: the head's rows are
the logits, where 4 bits cost the most quality for the least memory); an expert block's experts take the same
values (layers/quantization/experts.Int4Experts). Activations stay in the model's dtype. The C int4 matmuls run
it on the CPU (the layout AWQ / GPTQ / GGUF Q4 weights use); CUDA has no kernel for it and is refused at start."""

from __future__ import annotations

from radixgen.runtime.layers.quantization.base import CpuPackedLinear, Format, QuantizedWeight, TorchQuantizedLinear


class Int4FromFloat(Format):
    name = "int4"

    def quantized(self, layer):
        return QuantizedWeight.int4_from(layer.weight.detach())


INT4 = Int4FromFloat()


def refuse_on_cuda(ops: str) -> None:
    if ops == "triton":
        raise ValueError("quantization=int4 runs on the CPU (its matmuls are the C int4 kernels); on CUDA use "
                         "quantization int8 or fp8, or an AWQ / GPTQ checkpoint")


def method(ops: str, spec, layer, kl):
    refuse_on_cuda(ops)
    if layer.in_features % 32:
        raise ValueError(f"int4 needs input sizes that are a multiple of 32, got {layer.in_features} "
                         f"({type(layer).__name__})")
    if ops == "cpu" and kl is not None:
        return CpuPackedLinear(kl, INT4)
    return TorchQuantizedLinear(INT4)
