"""Weight quantization: the format of a model's linear layers (`resolve`: RuntimeConfig.quantization checked against
the checkpoint's config.json) and the linear method each layer gets for it on a device (`linear_method`, which
the ops sets call before the weights are loaded). One module per format: unquantized, int8, int4, awq, gptq, gguf, fp8;
base.py holds what they share (the values-and-scales record, the C-packed method, the torch reference method).
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from radixgen.runtime.config import QUANTIZATIONS

CHECKPOINT_METHODS = ("awq", "gptq", "fp8")  # quant_method values of config.json's quantization_config


@dataclass(frozen=True)
class QuantSpec:
    """A model's resolved weight format. group_size: input columns per scale (0: one group per output channel);
    zero_offset: what GPTQ's stored zeros lack (1 in its v1 format); from_float: quantized at load."""

    method: str = "none"
    group_size: int = 0
    zero_offset: int = 0
    from_float: bool = False

    def __str__(self) -> str:
        extra = f", group {self.group_size or 'per channel'}" if self.method in ("awq", "gptq") else ""
        return f"{self.method}{' (from a float checkpoint)' if self.from_float else ''}{extra}"


NONE = QuantSpec()


def _group(qc: dict, *keys: str) -> int:
    g = next((qc[k] for k in keys if k in qc), 128)
    if not isinstance(g, int) or isinstance(g, bool) or (g < 1 and g != -1):
        raise ValueError(f"quantization_config group_size must be a positive integer or -1, got {g!r}")
    return 0 if g == -1 else g


def _bits(qc: dict, method: str) -> None:
    bits = qc.get("bits", qc.get("w_bit", 4))
    if bits != 4:
        raise ValueError(f"{method} checkpoints of {bits} bits are not supported (4 bits only)")


def _unconverted(qc: dict, method: str) -> None:
    for key in ("modules_to_not_convert", "ignored_layers"):
        extra = sorted(set(qc.get(key) or ()) - {"lm_head"})
        if extra:
            raise ValueError(f"{method} quantization_config {key} {extra}: only the LM head may stay unquantized")


EXPERT_FORMATS = ("none", "int8", "int4", "gguf")  # the formats an expert block's experts have a grouped form in


def resolve(requested: str, hf_config: dict, gguf_native: bool = False, experts: bool = False) -> QuantSpec:
    """The format of a checkpoint (config.json `hf_config`; gguf_native: a GGUF run from its own blocks; experts: a
    mixture of experts') under the requested quantization; auto takes the checkpoint's. A request the checkpoint
    does not match is an error, as is a format an expert block has no kernel for (before the checkpoint's own
    details: an AWQ MoE's unconverted router is not the reason it cannot run)."""
    if requested not in QUANTIZATIONS:
        raise ValueError(f"quantization must be one of {', '.join(QUANTIZATIONS)}; got {requested!r}")
    qc = hf_config.get("quantization_config") or {}
    found = "gguf" if gguf_native else (str(qc.get("quant_method", "")).lower() or None)
    if found == "mxfp4" and "GptOssForCausalLM" in (hf_config.get("architectures") or ()):
        found = None  # gpt-oss's MXFP4 expert blocks: its loader's (models/gpt_oss.py); the rest is bf16
    if found is not None and found not in (*CHECKPOINT_METHODS, "gguf"):
        raise ValueError(f"the checkpoint's quantization_config has quant_method {found!r}, which radixgen does not "
                         f"support (supported: {', '.join(CHECKPOINT_METHODS)})")
    if requested == "auto":
        requested = found or "none"
    if experts and requested not in EXPERT_FORMATS:
        what = f"{requested} checkpoints" if requested == found else f"quantization={requested!r}"
        raise ValueError(f"{what} of mixture-of-experts models are not supported: the experts have no grouped "
                         f"{requested} kernel (supported with experts: {', '.join(EXPERT_FORMATS)})")
    if requested in ("int8", "int4", "fp8") and found is None:
        return QuantSpec(requested, from_float=True)
    if requested != (found or "none"):
        have = f"quantized with {found}" if found else "not quantized"
        where = {"gguf": "a .gguf file", "none": "an unquantized checkpoint", "int8": "a float checkpoint",
                 "int4": "a float checkpoint", "fp8": "an fp8 or float checkpoint", "awq": "an AWQ checkpoint",
                 "gptq": "a GPTQ checkpoint"}[requested]
        raise ValueError(f"quantization={requested!r} needs {where}, but the checkpoint is {have}"
                         + ("" if found is None or found == "gguf" else " (config.json quantization_config)"))
    if requested == "awq":
        _bits(qc, "awq")
        _unconverted(qc, "awq")
        if not qc.get("zero_point", True):
            raise ValueError("awq checkpoints without zero points (zero_point false) are not supported")
        version = str(qc.get("version", "gemm")).lower()
        if version != "gemm":
            raise ValueError(f"awq checkpoint version {version!r} is not supported (the GEMM layout only)")
        return QuantSpec("awq", group_size=_group(qc, "group_size", "q_group_size"))
    if requested == "gptq":
        _bits(qc, "gptq")
        _unconverted(qc, "gptq")
        fmt = qc.get("checkpoint_format", qc.get("format", "gptq"))
        if fmt not in ("gptq", "gptq_v2"):
            raise ValueError(f"gptq checkpoint_format {fmt!r} is not supported (gptq or gptq_v2)")
        return QuantSpec("gptq", group_size=_group(qc, "group_size"), zero_offset=1 if fmt == "gptq" else 0)
    if requested == "fp8":
        _unconverted(qc, "fp8")
        if qc.get("weight_block_size"):
            raise ValueError("fp8 checkpoints with block-wise scales (weight_block_size) are not supported; "
                             "per-tensor or per-channel scales only")
        if qc.get("activation_scheme", "dynamic") != "dynamic":
            raise ValueError(f"fp8 activation_scheme {qc['activation_scheme']!r} is not supported: radixgen's fp8 is "
                             f"weight-only (activation_scheme dynamic)")
    return QuantSpec(requested)


def linear_method(ops: str, spec: QuantSpec, layer, kl):
    """The method of linear `layer` for format `spec` under the ops set named `ops` ("torch", "cpu", "triton"; kl:
    its C kernels or None). Checkpoint formats and int4 leave the LM head unquantized."""
    from radixgen.runtime.layers.embedding import ParallelLMHead
    from radixgen.runtime.layers.quantization import awq, fp8, gguf, gptq, int4, int8, unquantized

    if spec.method == "none" or (spec.method in (*CHECKPOINT_METHODS, "int4") and isinstance(layer, ParallelLMHead)):
        if spec.method == "int4":
            int4.refuse_on_cuda(ops)
        return unquantized.method(ops, layer, kl)
    return {"int8": int8, "int4": int4, "awq": awq, "gptq": gptq, "gguf": gguf,
            "fp8": fp8}[spec.method].method(ops, spec, layer, kl)


def weight_bytes(model: nn.Module) -> int:
    """The bytes a loaded model's weights take, each in the one layout its layer holds (tables derived from the
    config, such as the rotary one, are not weights)."""
    from radixgen.runtime.layers.linear import LinearBase
    from radixgen.runtime.layers.quantization.experts import GroupedLinear

    total = 0
    for m in model.modules():
        if isinstance(m, (LinearBase, GroupedLinear)):  # (an expert block's experts: their method's layout)
            total += m.method.nbytes(m)
        else:
            total += sum(p.numel() * p.element_size() for p in m.parameters(recurse=False))
    return total
