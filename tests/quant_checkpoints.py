"""Quantized checkpoints written by the tests themselves, from the tiny random models (tiny_models.py), in the
layouts AutoAWQ, AutoGPTQ and FP8 checkpoints use. The packing here is written from the formats' public
descriptions, independently of radixgen's loaders:

- AWQ (GEMM): qweight (in, out / 8) and qzeros (in / group, out / 8) int32, eight 4-bit values per int32 along
  the output dim; nibble i (bits 4i .. 4i + 3) of packed column c holds output column 8c + [0, 2, 4, 6, 1, 3, 5,
  7][i]; scales (in / group, out) fp16; w = (q - zero) * scale.
- GPTQ: qweight (in / 8, out) int32 along the input dim, nibble i of row r = input row 8r + i; qzeros
  (in / group, out / 8) along the output dim, nibble i of column c = output 8c + i, storing zero - 1 in the
  "gptq" (v1) checkpoint format and zero in "gptq_v2"; scales (in / group, out) fp16; g_idx (in,) int32, the
  group of each input row (activation order, desc_act: the groups are sets of columns in a permuted order).
- FP8: weight float8_e4m3fn (out, in) with weight_scale, one float32 per tensor or per output row (out, 1).

Each writer returns the folder and the dense float32 weights the checkpoint stands for (to give transformers
the same weights)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from tiny_models import tiny_model_dir

LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
AWQ_NIBBLE_COLUMN = (0, 2, 4, 6, 1, 3, 5, 7)


def quantize_groups(w: torch.Tensor, groups: torch.Tensor, n_groups: int):
    """Asymmetric 4-bit min-max quantization of w (out, in) with input column k in group groups[k]:
    (q (out, in) in 0..15, zeros (out, n_groups) in 0..15, fp16 scales (out, n_groups)), and the dequantized
    weight (q - zero) * scale."""
    out_f, _ = w.shape
    q = torch.empty_like(w, dtype=torch.int32)
    zeros = torch.empty(out_f, n_groups, dtype=torch.int32)
    scales = torch.empty(out_f, n_groups, dtype=torch.float16)
    for g in range(n_groups):
        cols = (groups == g).nonzero().flatten()
        part = w[:, cols]
        lo, hi = part.min(1).values.clamp(max=0), part.max(1).values.clamp(min=0)
        s = ((hi - lo) / 15).clamp(min=1e-4).half()
        z = torch.round(-lo / s.float()).clamp(0, 15).int()
        q[:, cols] = (torch.round(part / s.float()[:, None]) + z[:, None]).clamp(0, 15).int()
        zeros[:, g], scales[:, g] = z, s
    dense = (q - zeros[:, groups]).float() * scales.float()[:, groups]
    return q, zeros, scales, dense


def pack_along_cols(v: torch.Tensor, order=tuple(range(8))) -> torch.Tensor:
    """(R, 8C) values 0..15 -> (R, C) int32, nibble i of column c = column 8c + order[i]."""
    v = v.to(torch.int64).view(v.shape[0], -1, 8)
    word = torch.zeros(v.shape[:2], dtype=torch.int64)
    for i, col in enumerate(order):
        word |= v[..., col] << (4 * i)
    return torch.where(word >= 2**31, word - 2**32, word).to(torch.int32)


def pack_along_rows(v: torch.Tensor) -> torch.Tensor:
    """(8R, C) values 0..15 -> (R, C) int32, nibble i of row r = row 8r + i."""
    return pack_along_cols(v.t().contiguous()).t().contiguous()


def _copy_model(arch: str, out: Path) -> tuple[dict, dict, dict]:
    """The tiny model's files but its weights into `out`: (its other tensors, its linear layers' weights by name,
    its config)."""
    src = tiny_model_dir(arch)
    out.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.name not in ("DONE", "model.safetensors"):
            shutil.copy(f, out / f.name)
    state = load_file(str(src / "model.safetensors"))
    linear = {n: t for n, t in state.items() if n.endswith(".weight") and n.rsplit(".", 2)[-2] in LINEARS}
    others = {n: t for n, t in state.items() if n not in linear}
    return others, linear, json.loads((src / "config.json").read_text())


def _finish(out: Path, tensors: dict, config: dict, quant: dict | None) -> None:
    if quant is not None:
        config["quantization_config"] = quant
    (out / "config.json").write_text(json.dumps(config, indent=2))
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(out / "model.safetensors"))


def write_awq(out: Path, arch: str = "llama", group: int = 32, config_group: int | None = None):
    tensors, linear, config = _copy_model(arch, out)
    dense = {}
    for name, t in linear.items():
        k = t.shape[1]
        q, z, s, d = quantize_groups(t.float(), torch.arange(k) // group, k // group)
        base = name.removesuffix(".weight")
        tensors[f"{base}.qweight"] = pack_along_cols(q.t(), AWQ_NIBBLE_COLUMN)
        tensors[f"{base}.qzeros"] = pack_along_cols(z.t(), AWQ_NIBBLE_COLUMN)
        tensors[f"{base}.scales"] = s.t()
        dense[name] = d
    _finish(out, tensors, config, {"quant_method": "awq", "bits": 4, "group_size": config_group or group,
                                   "zero_point": True, "version": "gemm"})
    return out, dense


def write_gptq(out: Path, arch: str = "llama", group: int = 32, act_order: bool = False, v2: bool = False):
    """GPTQ with `group`; act_order: every linear's groups over a permuted column order (the same permutation
    for the projections that share an input, as GPTQ's activation order gives them)."""
    tensors, linear, config = _copy_model(arch, out)
    gen = torch.Generator().manual_seed(7)
    perms: dict[tuple[str, int], torch.Tensor] = {}
    dense = {}
    for name, t in linear.items():
        proj = name.rsplit(".", 2)[-2]
        k = t.shape[1]
        shared_input = {"k_proj": "q_proj", "v_proj": "q_proj", "up_proj": "gate_proj"}.get(proj, proj)
        key = (name.rsplit(".", 3)[0] + shared_input, k)
        if key not in perms:
            perms[key] = torch.randperm(k, generator=gen) if act_order else torch.arange(k)
        groups = torch.empty(k, dtype=torch.int32)
        groups[perms[key]] = (torch.arange(k) // group).int()  # column perm[j] is the j-th in activation order
        q, z, s, d = quantize_groups(t.float(), groups.long(), k // group)
        if not v2:
            z = z.clamp(min=1) - 1  # v1 stores zero - 1 (a zero of 0 would not survive it)
            d = (q - (z + 1)[:, groups.long()]).float() * s.float()[:, groups.long()]
        base = name.removesuffix(".weight")
        tensors[f"{base}.qweight"] = pack_along_rows(q.t().contiguous())
        tensors[f"{base}.qzeros"] = pack_along_cols(z.t())
        tensors[f"{base}.scales"] = s.t()
        tensors[f"{base}.g_idx"] = groups
        dense[name] = d
    _finish(out, tensors, config, {"quant_method": "gptq", "bits": 4, "group_size": group, "desc_act": act_order,
                                   "sym": False, "checkpoint_format": "gptq_v2" if v2 else "gptq"})
    return out, dense


def write_fp8(out: Path, arch: str = "llama"):
    """FP8 weights: per-tensor scales for attention, per-channel (out, 1) for the MLP."""
    tensors, linear, config = _copy_model(arch, out)
    dense = {}
    for name, t in linear.items():
        w = t.float()
        per_channel = name.rsplit(".", 2)[-2] in ("gate_proj", "up_proj", "down_proj")
        amax = w.abs().amax(1, keepdim=True) if per_channel else w.abs().amax()
        scale = (amax / 448).float()
        values = (w / scale).to(torch.float8_e4m3fn)
        tensors[name] = values
        tensors[name.removesuffix("weight") + "weight_scale"] = scale if per_channel else scale.reshape(())
        dense[name] = values.float() * scale
    _finish(out, tensors, config, {"quant_method": "fp8", "activation_scheme": "dynamic"})
    return out, dense


def reference_model(folder: Path, dense: dict):
    """transformers' model of `folder`'s architecture with the given dense weights (and the checkpoint's other
    tensors: embeddings, norms, LM head), float32."""
    import transformers as tf

    config = tf.AutoConfig.from_pretrained(folder)
    config.quantization_config = None
    del config.quantization_config
    model = tf.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    state = {k: v for k, v in load_file(str(folder / "model.safetensors")).items() if v.is_floating_point()
             and v.dtype != torch.float8_e4m3fn}
    missing, _ = model.load_state_dict({**state, **dense}, strict=False)
    assert all("rotary" in m or "lm_head" in m for m in missing), missing
    return model
