"""FP8 (e4m3) weights, w = scale * value, one float32 scale per tensor or per output channel; weight-only (the
activations stay in the model's dtype).

From a checkpoint whose quantization_config has quant_method "fp8" (per linear layer: weight float8_e4m3fn
(out, in) and weight_scale of shape (), (1,), (out,) or (out, 1); block-wise scales and static activation scales
are refused by the config check), or quantized at load from a float checkpoint (scale = max |row| / 448). The
LM head stays unquantized. CUDA: the Triton kernel, which converts the values in registers. CPU (and TorchOps):
an upcast path, chosen over a C kernel because FP8 weights come from GPU checkpoints: the fp8 values stay as
they are (a byte per weight) and each call dequantizes the weight a tile of rows at a time to the activations'
dtype for F.linear; the fused decode step does not take these layers."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from radixgen.runtime.layers.linear import LinearMethod, new_param

FP8_MAX = 448.0  # the largest e4m3 value
TILE_ELEMS = 1 << 21  # weights dequantized at once on the upcast path


class FP8Format:
    name = "fp8"

    def __init__(self, from_float: bool) -> None:
        self.from_float = from_float

    def create_weights(self, layer):
        if self.from_float:
            return  # the dense weight, quantized in process_weights
        n, k = layer.out_features, layer.in_features
        layer.weight = new_param((n, k), torch.float8_e4m3fn, layer.weight_loader, 0, 1)
        # per channel as (out,) or (out, 1), or one value for the tensor (linear.py's `fill`)
        layer.weight_scale = new_param((n,), torch.float32, layer.weight_loader, 0, None)
        layer.weight_scale.fill = True

    def fp8(self, layer) -> tuple[torch.Tensor, torch.Tensor]:
        """(values (out, in) float8_e4m3fn, scales (out,) float32), and the checkpoint's parameters dropped."""
        if self.from_float:
            w = layer.weight.detach().float()
            scales = (w.abs().amax(1) / FP8_MAX).clamp_min(torch.finfo(torch.float32).tiny)
            values = (w / scales[:, None]).to(torch.float8_e4m3fn)
        else:
            values, scales = layer.weight.data, layer.weight_scale.data.clone()
            layer.weight_scale = None
        layer.weight = None
        return values, scales


class FP8Linear(LinearMethod):
    """The upcast path (CPU, TorchOps): fp8 values and scales as buffers, dequantized a tile of rows at a time."""

    def __init__(self, fmt: FP8Format, name: str = "fp8 (upcast)") -> None:
        self.fmt, self.name = fmt, name

    def create_weights(self, layer):
        self.fmt.create_weights(layer)

    def process_weights(self, layer):
        values, scales = self.fmt.fp8(layer)
        layer.register_buffer("qweight", values, persistent=False)
        layer.register_buffer("qscale", scales, persistent=False)

    def apply(self, layer, x):
        n = layer.out_features
        rows = max(1, TILE_ELEMS // layer.in_features)
        y = torch.empty((*x.shape[:-1], n), dtype=x.dtype, device=x.device)
        for n0 in range(0, n, rows):  # rows [n0, n1) of the weight, dequantized to x's dtype
            n1 = min(n, n0 + rows)
            w = (layer.qweight[n0:n1].float() * layer.qscale[n0:n1, None]).to(x.dtype)
            y[..., n0:n1] = F.linear(x, w, None if layer.bias is None else layer.bias[n0:n1])
        return y

    def dequantize(self, layer):
        return layer.qweight.float() * layer.qscale[:, None]


class TritonFP8Linear(FP8Linear):
    """CUDA: the same buffers through the Triton FP8 dequantizing matmul."""

    batch_invariant = False  # the deterministic mode: one row tile whatever the row count

    def apply(self, layer, x):
        from radixgen import kernels

        y = kernels.fp8_matmul(x.reshape(-1, layer.in_features), layer.qweight, layer.qscale, layer.bias,
                               batch_invariant=self.batch_invariant)
        return y.view(*x.shape[:-1], layer.out_features)


def method(ops: str, spec, layer, kl):
    fmt = FP8Format(spec.from_float)
    return TritonFP8Linear(fmt, "fp8 (triton)") if ops == "triton" else FP8Linear(fmt)
