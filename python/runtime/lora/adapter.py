"""Load a PEFT LoRA adapter folder (adapter_config.json + adapter_model.safetensors) into per-layer weights.

Each target module's (A, B) pair is kept as-is (A: [r, in], B: [out, r]); the scale is lora_alpha / r, or
lora_alpha / sqrt(r) with use_rslora. Target names map onto the model's merged projections: q/k/v -> qkv_proj,
o -> o_proj, gate/up -> gate_up_proj, down -> down_proj. Every problem raises LoRAAdapterError naming it.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch

from radixgen.common.lora_names import (  # noqa: F401 - the adapter's names, imported from here too
    TARGETS,
    LoRAAdapterError,
    check_adapter_name,
    check_target_names,
    parse_lora_paths,
)

_KEY = re.compile(r"(?:^|\.)layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])\.weight$")
# adapter_config.json keys whose non-default value changes the math in a way radixgen does not implement
_UNSUPPORTED = {
    "use_dora": "DoRA (use_dora)", "fan_in_fan_out": "fan_in_fan_out", "lora_bias": "LoRA biases (lora_bias)",
    "rank_pattern": "per-module ranks (rank_pattern)", "alpha_pattern": "per-module alphas (alpha_pattern)",
    "modules_to_save": "fully trained extra modules (modules_to_save)", "megatron_config": "Megatron layers",
}



def read_adapter_config(name: str, folder: Path) -> dict:
    """adapter_config.json as a dict, checked for what radixgen serves (LoRA, no DoRA, no per-module ranks...)."""
    cfg_file = folder / "adapter_config.json"
    if not cfg_file.is_file():
        raise LoRAAdapterError(f"LoRA adapter {name!r}: no adapter_config.json in {folder}")
    try:
        cfg = json.loads(cfg_file.read_text())
    except (OSError, ValueError) as e:
        raise LoRAAdapterError(f"LoRA adapter {name!r}: unreadable adapter_config.json: {e}") from e
    if not isinstance(cfg, dict):
        raise LoRAAdapterError(f"LoRA adapter {name!r}: adapter_config.json is not an object")
    if cfg.get("peft_type", "LORA") != "LORA":
        raise LoRAAdapterError(f"LoRA adapter {name!r}: peft_type {cfg.get('peft_type')!r} is not LORA")
    for key, feature in _UNSUPPORTED.items():
        if cfg.get(key):
            raise LoRAAdapterError(f"LoRA adapter {name!r}: {feature} is not supported")
    if cfg.get("bias", "none") != "none":
        raise LoRAAdapterError(f"LoRA adapter {name!r}: trained biases (bias={cfg['bias']!r}) are not supported")
    return cfg


def peek_adapter(name: str, path: str | Path) -> tuple[int, tuple[str, ...]]:
    """(rank, target modules) of an adapter folder from its config alone (sizes the pool before any weight is
    read); the same checks as load_lora_adapter."""
    cfg = read_adapter_config(name, Path(path))
    return _rank(name, cfg), _targets(name, cfg)


def _rank(name: str, cfg: dict) -> int:
    r = cfg.get("r")
    if not isinstance(r, int) or isinstance(r, bool) or r <= 0:
        raise LoRAAdapterError(f"LoRA adapter {name!r}: r must be a positive integer, got {r!r}")
    return r


def _targets(name: str, cfg: dict) -> tuple[str, ...]:
    targets = cfg.get("target_modules")
    if targets == "all-linear":  # PEFT's shorthand: every linear layer but the output head
        targets = list(TARGETS)
    elif isinstance(targets, str):
        targets = [targets]
    if not isinstance(targets, list) or not targets:
        raise LoRAAdapterError(f"LoRA adapter {name!r}: target_modules must be a non-empty list")
    unknown = sorted(set(targets) - TARGETS.keys())
    if unknown:
        raise LoRAAdapterError(f"LoRA adapter {name!r}: unknown target modules {unknown} "
                               f"(supported: {sorted(TARGETS)})")
    return tuple(targets)


@dataclass
class LoRAAdapter:
    name: str
    path: str
    rank: int
    scale: float
    target_modules: tuple[str, ...]
    # (layer index, target module e.g. "q_proj") -> (A [r, in], B [out, r])
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)


def load_lora_adapter(name: str, path: str | Path, max_lora_rank: int | None = None) -> LoRAAdapter:
    folder = Path(path)
    cfg = read_adapter_config(name, folder)
    r = _rank(name, cfg)
    alpha = cfg.get("lora_alpha", r)
    if max_lora_rank is not None and r > max_lora_rank:
        raise LoRAAdapterError(f"LoRA adapter {name!r}: rank {r} exceeds max_lora_rank {max_lora_rank}")
    if not isinstance(alpha, (int, float)) or isinstance(alpha, bool):
        raise LoRAAdapterError(f"LoRA adapter {name!r}: lora_alpha must be a number, got {alpha!r}")
    targets = _targets(name, cfg)
    scale = alpha / math.sqrt(r) if cfg.get("use_rslora") else alpha / r
    weights = _read_weights(name, folder)
    pairs: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, t in weights.items():
        m = _KEY.search(key)
        if m is None:
            raise LoRAAdapterError(f"LoRA adapter {name!r}: unexpected tensor {key!r}")
        layer, module, ab = int(m.group(1)), m.group(2), m.group(3)
        if module not in targets:
            raise LoRAAdapterError(f"LoRA adapter {name!r}: tensor {key!r} is for {module!r}, "
                                   f"not in target_modules")
        pairs.setdefault((layer, module), {})[ab] = t
    adapter = LoRAAdapter(name, str(folder), r, float(scale), tuple(targets))
    for (layer, module), ab in sorted(pairs.items()):
        if set(ab) != {"A", "B"}:
            raise LoRAAdapterError(f"LoRA adapter {name!r}: layer {layer} {module} lacks lora_"
                                   f"{'B' if 'A' in ab else 'A'}")
        a, b = ab["A"], ab["B"]
        if a.dim() != 2 or b.dim() != 2 or a.shape[0] != r or b.shape[1] != r:
            raise LoRAAdapterError(f"LoRA adapter {name!r}: layer {layer} {module} shapes "
                                   f"A{tuple(a.shape)} B{tuple(b.shape)} do not match rank {r}")
        adapter.weights[(layer, module)] = (a, b)
    if not adapter.weights:
        raise LoRAAdapterError(f"LoRA adapter {name!r}: no LoRA tensors in {folder}")
    return adapter


def _read_weights(name: str, folder: Path) -> dict[str, torch.Tensor]:
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    file = folder / "adapter_model.safetensors"
    if not file.is_file():
        raise LoRAAdapterError(f"LoRA adapter {name!r}: no adapter_model.safetensors in {folder}")
    try:
        return load_file(str(file))
    except (SafetensorError, OSError, ValueError) as e:
        raise LoRAAdapterError(f"LoRA adapter {name!r}: broken adapter_model.safetensors: {e}") from e


def check_adapter_fits(adapter: LoRAAdapter, model) -> None:
    """Raise LoRAAdapterError when the adapter's layers or (in, out) sizes differ from the model's (a ModelConfig)."""
    h, i = model.hidden_size, model.intermediate_size
    q, kv = model.num_heads * model.head_dim, model.num_kv_heads * model.head_dim
    sizes = {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h),
             "gate_proj": (h, i), "up_proj": (h, i), "down_proj": (i, h)}
    for (layer, module), (a, b) in adapter.weights.items():
        if layer >= model.num_layers:
            raise LoRAAdapterError(f"LoRA adapter {adapter.name!r}: layer {layer} but the model has "
                                   f"{model.num_layers} layers")
        if (a.shape[1], b.shape[0]) != sizes[module]:
            raise LoRAAdapterError(f"LoRA adapter {adapter.name!r}: layer {layer} {module} maps "
                                   f"{a.shape[1]} -> {b.shape[0]}, the model's maps "
                                   f"{sizes[module][0]} -> {sizes[module][1]}")
