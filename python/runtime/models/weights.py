"""Declared weight mappings: a checkpoint's tensor names to a model's parameters, per part, composed per architecture.

A part (models/parts.py) declares the names its parameters have in a Hugging Face checkpoint and in a GGUF file;
an architecture's mapping is the sum of its parts' (`+`). The loader reads GGUF files through the mapping of the
file's architecture (GGUF names -> HF names), and the model loads HF names through its own (projections that
our layers merge -> the merged parameter and its shard id).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import NamedTuple


class ExpertShard(NamedTuple):
    """Where a checkpoint's expert tensor goes in an expert block's GroupedLinear: expert `expert`'s tensor, or all
    experts stacked (None: (E, out, in)); `part` gate / up (the halves of gate_up), gate_up (both) or down."""

    expert: int | None
    part: str


_ONE_EXPERT = re.compile(r"\.experts\.(\d+)\.(\w+)\.weight$")  # ...experts.<e>.<projection>.weight
_ALL_EXPERTS = re.compile(r"\.experts\.(\w+)$")  # ...experts.<projection>: every expert, stacked (E, out, in)
# the stacked names: transformers' fused layout (gate_up_proj (E, 2I, H), down_proj (E, H, I)), and the gate / up
# stacks a GGUF file's *_exps tensors become
STACKED_EXPERTS = (("gate_up_proj", "gate_up", "gate_up"), ("gate_proj", "gate_up", "gate"),
                   ("up_proj", "gate_up", "up"), ("down_proj", "down", "down"))


@dataclass(frozen=True)
class WeightMapping:
    """stacked: (checkpoint projection, our merged layer, shard id), the checkpoint name's ".<projection>." part
    replaced by ".<merged layer>.". gguf_globals: GGUF name -> HF name outside the blocks; gguf_block: GGUF
    block-tensor suffix -> HF suffix (blk.N.<a> -> model.layers.N.<b>); gguf_matmuls: the block suffixes that
    are matmul weights (a native GGUF load hands them over in their blocks); gguf_rope_permuted: the file's
    Q / K rows are in llama.cpp's interleaved rotary order (its "llama" architecture), undone on load."""

    stacked: tuple[tuple[str, str, object], ...] = ()
    gguf_globals: tuple[tuple[str, str], ...] = ()
    gguf_block: tuple[tuple[str, str], ...] = ()
    gguf_matmuls: frozenset[str] = frozenset()
    gguf_rope_permuted: bool = False
    experts: tuple[tuple[str, str, str], ...] = ()  # (checkpoint projection, our GroupedLinear, ExpertShard.part)
    renames: tuple[tuple[str, str], ...] = ()  # checkpoint name parts -> ours (Mixtral's block_sparse_moe -> mlp)

    def __add__(self, other: WeightMapping) -> WeightMapping:
        return WeightMapping(self.stacked + other.stacked, self.gguf_globals + other.gguf_globals,
                             self.gguf_block + other.gguf_block, self.gguf_matmuls | other.gguf_matmuls,
                             self.gguf_rope_permuted or other.gguf_rope_permuted, self.experts + other.experts,
                             self.renames + other.renames)

    def with_rope_permuted(self) -> WeightMapping:
        return WeightMapping(self.stacked, self.gguf_globals, self.gguf_block, self.gguf_matmuls, True, self.experts,
                             self.renames)

    def parameter(self, name: str) -> tuple[str, object]:
        """(our parameter name, shard id or None) of checkpoint tensor `name` (without "model."); an expert's
        tensor (per expert, or all stacked) -> its block's GroupedLinear and an ExpertShard."""
        for old, new in self.renames:
            name = name.replace(old, new)
        if self.experts:
            m = _ONE_EXPERT.search(name)
            for ckpt, ours, part in self.experts if m else ():
                if m.group(2) == ckpt:
                    return f"{name[:m.start()]}.experts.{ours}.weight", ExpertShard(int(m.group(1)), part)
            m = _ALL_EXPERTS.search(name)
            for ckpt, ours, part in STACKED_EXPERTS if m else ():
                if m.group(1) == ckpt:
                    return f"{name[:m.start()]}.experts.{ours}.weight", ExpertShard(None, part)
        for ckpt, ours, shard_id in self.stacked:
            if f".{ckpt}." in name:
                return name.replace(f".{ckpt}.", f".{ours}."), shard_id
        return name, None

    def hf_name(self, gguf_name: str) -> str | None:
        """The HF checkpoint name of a GGUF tensor, or None for one recomputed from the config (rope_freqs)."""
        for g, hf in self.gguf_globals:
            if g == gguf_name:
                return hf
        parts = gguf_name.split(".", 2)
        if parts[0] != "blk" or len(parts) < 3:
            return None
        for g, hf in self.gguf_block:
            if g == parts[2]:
                return f"model.layers.{parts[1]}.{hf}"
        return None

    def is_gguf_matmul(self, gguf_name: str) -> bool:
        return gguf_name.startswith("blk.") and gguf_name.split(".", 2)[2] in self.gguf_matmuls

    def is_gguf_block(self, gguf_name: str, suffix: str) -> bool:
        return gguf_name.startswith("blk.") and gguf_name.split(".", 2)[2] == suffix


# the parts' names (models/parts.py)
DECODER_WEIGHTS = WeightMapping(
    gguf_globals=(("token_embd.weight", "model.embed_tokens.weight"), ("output_norm.weight", "model.norm.weight"),
                  ("output.weight", "lm_head.weight")),
    gguf_block=(("attn_norm.weight", "input_layernorm.weight"), ("ffn_norm.weight", "post_attention_layernorm.weight")),
)
ATTENTION_WEIGHTS = WeightMapping(
    stacked=(("q_proj", "qkv_proj", "q"), ("k_proj", "qkv_proj", "k"), ("v_proj", "qkv_proj", "v")),
    gguf_block=(("attn_q.weight", "self_attn.q_proj.weight"), ("attn_k.weight", "self_attn.k_proj.weight"),
                ("attn_v.weight", "self_attn.v_proj.weight"), ("attn_output.weight", "self_attn.o_proj.weight")),
    gguf_matmuls=frozenset({"attn_q.weight", "attn_k.weight", "attn_v.weight", "attn_output.weight"}),
)
QKV_BIAS_WEIGHTS = WeightMapping(gguf_block=(("attn_q.bias", "self_attn.q_proj.bias"),
                                             ("attn_k.bias", "self_attn.k_proj.bias"),
                                             ("attn_v.bias", "self_attn.v_proj.bias")))
QK_NORM_WEIGHTS = WeightMapping(gguf_block=(("attn_q_norm.weight", "self_attn.q_norm.weight"),
                                            ("attn_k_norm.weight", "self_attn.k_norm.weight")))
GATED_MLP_WEIGHTS = WeightMapping(
    stacked=(("gate_proj", "gate_up_proj", 0), ("up_proj", "gate_up_proj", 1)),
    gguf_block=(("ffn_gate.weight", "mlp.gate_proj.weight"), ("ffn_up.weight", "mlp.up_proj.weight"),
                ("ffn_down.weight", "mlp.down_proj.weight")),
    gguf_matmuls=frozenset({"ffn_gate.weight", "ffn_up.weight", "ffn_down.weight"}),
)

# expert blocks (models/moe_block.py): the router `mlp.gate`, the experts, Qwen2-MoE's shared expert and its gate
_MOE_GGUF = WeightMapping(
    gguf_block=(("ffn_gate_inp.weight", "mlp.gate.weight"), ("ffn_gate_exps.weight", "mlp.experts.gate_proj"),
                ("ffn_up_exps.weight", "mlp.experts.up_proj"), ("ffn_down_exps.weight", "mlp.experts.down_proj")),
    gguf_matmuls=frozenset({"ffn_gate_exps.weight", "ffn_up_exps.weight", "ffn_down_exps.weight"}))
QWEN_MOE_WEIGHTS = _MOE_GGUF + WeightMapping(
    experts=(("gate_proj", "gate_up", "gate"), ("up_proj", "gate_up", "up"), ("down_proj", "down", "down")))
SHARED_EXPERT_WEIGHTS = WeightMapping(
    gguf_block=(("ffn_gate_inp_shexp.weight", "mlp.shared_expert_gate.weight"),
                ("ffn_gate_shexp.weight", "mlp.shared_expert.gate_proj.weight"),
                ("ffn_up_shexp.weight", "mlp.shared_expert.up_proj.weight"),
                ("ffn_down_shexp.weight", "mlp.shared_expert.down_proj.weight")),
    gguf_matmuls=frozenset({"ffn_gate_shexp.weight", "ffn_up_shexp.weight", "ffn_down_shexp.weight"}))
MIXTRAL_WEIGHTS = _MOE_GGUF + WeightMapping(
    experts=(("w1", "gate_up", "gate"), ("w3", "gate_up", "up"), ("w2", "down", "down")),
    renames=((".block_sparse_moe.", ".mlp."),))


class RowsOf:
    """Rows [start, start + rows) of a checkpoint tensor (a torch tensor or an executor.weights.CheckpointSlice),
    itself a tensor as the weight loaders read one (`shape`, `narrow`, `read`): a part of a fused tensor (Phi-3's
    qkv_proj, gate_up_proj) loaded as the projection it holds, still read lazily."""

    def __init__(self, base, start: int, rows: int) -> None:
        self.base, self.start = base, start
        self.shape = (rows, *tuple(base.shape)[1:])

    def narrow(self, dim: int, start: int, length: int):
        if dim == 0:
            return self.base.narrow(0, self.start + start, length)
        return self.base.narrow(0, self.start, self.shape[0]).narrow(dim, start, length)

    def read(self):
        return self.base.narrow(0, self.start, self.shape[0])


def split_fused(weights, fused: dict[str, tuple[tuple[str, int], ...]]):
    """Checkpoint tensors with each fused projection (".<fused>." in its name, fused -> ((part, rows), ...))
    replaced by its parts' tensors, named ".<part>." (the names the architecture's mapping loads by shard)."""
    for name, tensor in weights:
        for key, parts in fused.items():
            if f".{key}." in name:
                if sum(rows for _, rows in parts) != tensor.shape[0]:
                    raise ValueError(f"checkpoint tensor {name!r} has {tensor.shape[0]} rows, expected "
                                     f"{' + '.join(f'{rows} ({part})' for part, rows in parts)}")
                start = 0
                for part, rows in parts:
                    yield name.replace(f".{key}.", f".{part}."), RowsOf(tensor, start, rows)
                    start += rows
                break
        else:
            yield name, tensor
