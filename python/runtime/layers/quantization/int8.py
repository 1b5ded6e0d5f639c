"""int8: weight-only, symmetric, one scale per output channel, quantized at load from a float checkpoint
(w = scale * q, q = round(w / scale), scale = max |row| / 127). The LM head is quantized too; a tied embedding
then reads its rows from the int8 head. Activations stay in the model's dtype."""

from __future__ import annotations

from radixgen.runtime.layers.linear import LinearMethod
from radixgen.runtime.layers.quantization.base import CpuPackedLinear, Format, QuantizedWeight, TorchQuantizedLinear


class Int8FromFloat(Format):
    name = "int8"

    def quantized(self, layer):
        return QuantizedWeight.int8_from(layer.weight.detach())


INT8 = Int8FromFloat()


class TritonInt8Linear(LinearMethod):
    """CUDA: the int8 values (N, K) and float32 scales (N,), through the Triton dequantizing matmul."""

    name = "int8 (triton)"
    batch_invariant = False  # the deterministic mode: one row tile whatever the row count

    def process_weights(self, layer):
        qw = INT8.quantized(layer)
        INT8.drop(layer)
        layer.register_buffer("qweight", qw.q, persistent=False)
        layer.register_buffer("weight_scale", qw.scales.reshape(-1).contiguous(), persistent=False)

    def apply(self, layer, x):
        from radixgen import kernels

        y = kernels.int8_matmul(x.reshape(-1, layer.in_features), layer.qweight, layer.weight_scale, layer.bias,
                                batch_invariant=self.batch_invariant)
        return y.view(*x.shape[:-1], layer.out_features)

    def dequantize(self, layer):
        return layer.qweight.float() * layer.weight_scale[:, None]

    def embed(self, layer, ids):  # only the rows asked for
        return (layer.qweight[ids].float() * layer.weight_scale[ids, None]).to(layer.dtype)


def method(ops: str, spec, layer, kl):
    if ops == "cpu" and kl is not None:
        if layer.in_features % 16:
            raise ValueError(f"int8 on the CPU needs input sizes that are multiples of 16, got {layer.in_features}")
        return CpuPackedLinear(kl, INT8)
    if ops == "triton":
        return TritonInt8Linear()
    return TorchQuantizedLinear(INT8)
