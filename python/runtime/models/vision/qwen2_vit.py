"""The Qwen2-VL and Qwen2.5-VL vision transformer: dynamic resolution (an image is as many 14x14 patches as its
resized size holds, no fixed grid), 2-D rotary over each patch's (row, column), a patch merger folding each
merge x merge block of patches into one language-model row. Qwen2.5-VL adds window attention (most blocks attend
within windows of `window_size` pixels; `full_attention_blocks` over the whole image), RMSNorm and a gated MLP.

Patches arrive as the image processor lays them out: (N, C * T * P * P) rows, ordered block-major over the merge
blocks (the P x P patches of one merge x merge block consecutive), which is the order the merger folds.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from radixgen.runtime.layers.linear import LinearBase, MergedColumnParallelLinear
from radixgen.runtime.layers.norm import RMSNorm
from radixgen.runtime.layers.ops import OpsLayer


@dataclass(frozen=True)
class VisionSpec:
    """A Qwen2(.5)-VL vision config, one shape for both: `window_size` 0 and no full-attention blocks is
    Qwen2-VL (every block attends over the whole image), norm "layer" its LayerNorm, mlp "quick_gelu" its
    fc1/fc2 MLP; Qwen2.5-VL is norm "rms" and mlp "gated" (down(act(gate(x)) * up(x)), with biases)."""

    depth: int
    embed_dim: int
    out_dim: int  # the language model's hidden size (the merger's output)
    num_heads: int
    mlp_dim: int
    patch_size: int = 14
    temporal_patch_size: int = 2
    merge_size: int = 2
    in_channels: int = 3
    window_size: int = 0
    full_attention_blocks: tuple[int, ...] = ()
    norm: str = "layer"
    mlp: str = "quick_gelu"
    act: str = "quick_gelu"
    rope_theta: float = 10000.0

    def __post_init__(self) -> None:
        if self.embed_dim % self.num_heads or (self.embed_dim // self.num_heads) % 4:
            raise ValueError(f"vision embed_dim {self.embed_dim} / {self.num_heads} heads: the head size must be a "
                             f"multiple of 4 (two rotary axes of rotate-half pairs)")

    @property
    def patch_features(self) -> int:
        return self.in_channels * self.temporal_patch_size * self.patch_size ** 2

    @classmethod
    def from_hf(cls, vc: dict, qwen2_5: bool) -> VisionSpec:
        theta = float((vc.get("rope_parameters") or {}).get("rope_theta", 10000.0))
        common = dict(depth=vc["depth"], num_heads=vc["num_heads"], patch_size=vc.get("patch_size", 14),
                      temporal_patch_size=vc.get("temporal_patch_size", 2), merge_size=vc.get("spatial_merge_size", 2),
                      in_channels=vc.get("in_channels", 3), rope_theta=theta)
        if qwen2_5:
            return cls(embed_dim=vc["hidden_size"], out_dim=vc["out_hidden_size"], mlp_dim=vc["intermediate_size"],
                       window_size=vc.get("window_size", 112),
                       full_attention_blocks=tuple(vc.get("fullatt_block_indexes", ())), norm="rms", mlp="gated",
                       act=vc.get("hidden_act", "silu"), **common)
        return cls(embed_dim=vc["embed_dim"], out_dim=vc["hidden_size"],
                   mlp_dim=int(vc["embed_dim"] * vc.get("mlp_ratio", 4)), act=vc.get("hidden_act", "quick_gelu"),
                   **common)


_ACTS = {"quick_gelu": lambda x: x * torch.sigmoid(1.702 * x), "silu": F.silu, "gelu": F.gelu,
         "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh")}


def _act(name: str):
    if name not in _ACTS:
        raise ValueError(f"vision hidden_act {name!r} is not supported (supported: {sorted(_ACTS)})")
    return _ACTS[name]


def _norm(spec: VisionSpec, dim: int) -> nn.Module:
    return RMSNorm(dim, 1e-6) if spec.norm == "rms" else nn.LayerNorm(dim, eps=1e-6)


class VisionAttention(OpsLayer):
    """Bidirectional attention within segments of the patch rows (an image, or a window of one)."""

    def __init__(self, spec: VisionSpec) -> None:
        super().__init__()
        self.num_heads, self.head_dim = spec.num_heads, spec.embed_dim // spec.num_heads
        self.qkv = LinearBase(spec.embed_dim, 3 * spec.embed_dim, bias=True)
        self.proj = LinearBase(spec.embed_dim, spec.embed_dim, bias=True)

    def forward(self, x: torch.Tensor, rows: torch.Tensor, table: torch.Tensor, segments) -> torch.Tensor:
        n = x.shape[0]
        q, k, v = self.qkv(x).view(n, 3, self.num_heads, self.head_dim).unbind(1)  # (N, H, d) each
        q, k = self.ops.rotary(rows, q, k, table)
        if len(segments) == 1 and segments[0][0] is None:  # one image (or equal ones): no gather, no scatter
            length = segments[0][1]
            qs, ks, vs = (t.reshape(-1, length, self.num_heads, self.head_dim).transpose(1, 2) for t in (q, k, v))
            o = F.scaled_dot_product_attention(qs, ks, vs)  # (S, H, L, d)
            return self.proj(o.transpose(1, 2).reshape(n, -1))
        out = torch.empty_like(q)
        for index, length in segments:  # equal-length segments in one batched call
            qs, ks, vs = (t.index_select(0, index).view(-1, length, self.num_heads, self.head_dim).transpose(1, 2)
                          for t in (q, k, v))  # (S, H, L, d)
            o = F.scaled_dot_product_attention(qs, ks, vs)
            out.index_copy_(0, index, o.transpose(1, 2).reshape(-1, self.num_heads, self.head_dim))
        return self.proj(out.view(n, -1))


class VisionMLP(nn.Module):
    def __init__(self, spec: VisionSpec) -> None:
        super().__init__()
        self.gated = spec.mlp == "gated"
        self.act = _act(spec.act)
        if self.gated:
            self.gate_up_proj = MergedColumnParallelLinear(spec.embed_dim, [spec.mlp_dim] * 2, bias=True)
            self.down_proj = LinearBase(spec.mlp_dim, spec.embed_dim, bias=True)
        else:
            self.fc1 = LinearBase(spec.embed_dim, spec.mlp_dim, bias=True)
            self.fc2 = LinearBase(spec.mlp_dim, spec.embed_dim, bias=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gated:
            gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
            return self.down_proj(self.act(gate) * up)
        return self.fc2(self.act(self.fc1(x)))


class VisionBlock(nn.Module):
    def __init__(self, spec: VisionSpec) -> None:
        super().__init__()
        self.norm1, self.norm2 = _norm(spec, spec.embed_dim), _norm(spec, spec.embed_dim)
        self.attn = VisionAttention(spec)
        self.mlp = VisionMLP(spec)

    def forward(self, x, rows, table, segments):
        x = x + self.attn(self.norm1(x), rows, table, segments)
        return x + self.mlp(self.norm2(x))


class PatchMerger(nn.Module):
    """Norm, then each merge x merge block of patch rows concatenated and projected to the LM's hidden size."""

    def __init__(self, spec: VisionSpec) -> None:
        super().__init__()
        self.width = spec.embed_dim * spec.merge_size ** 2
        self.ln_q = _norm(spec, spec.embed_dim)
        self.mlp = nn.Sequential(LinearBase(self.width, self.width, bias=True), nn.GELU(),
                                 LinearBase(self.width, spec.out_dim, bias=True))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp(self.ln_q(x).view(-1, self.width))


class Layout(NamedTuple):
    """Where each patch row goes, for one encode call over images of grids `grids`: the rotary table (rows in
    the encoder's order, cos | sin halves), the segments a full-attention block and a windowed block attend
    within (each a list of (row index, segment length): the rows of all segments of that length), and the
    permutation of the patch rows into window order (None: no windows), whose inverse the merged rows undo."""

    table: torch.Tensor
    full: list
    windowed: list
    order: torch.Tensor | None
    merged_order: torch.Tensor | None


def _grouped(lengths: list[int], device) -> list[tuple[torch.Tensor | None, int]]:
    """Consecutive segments of `lengths` rows, grouped by length: [(rows of every segment of length L, L)]; rows
    None where one group is every row in order (all segments of one length)."""
    by_len, start = {}, 0
    for n in lengths:
        by_len.setdefault(n, []).append(torch.arange(start, start + n))
        start += n
    if len(by_len) == 1:
        return [(None, lengths[0])]
    return [(torch.cat(parts).to(device), n) for n, parts in by_len.items() if n > 0]


class Qwen2VisionTransformer(nn.Module):
    """Patch rows (N, C * T * P * P) of images with grids [(t, h, w)] (in patches) -> (N / merge^2, out_dim)."""

    def __init__(self, spec: VisionSpec) -> None:
        super().__init__()
        self.spec = spec
        # the Conv3d whose kernel equals its stride over one patch is a matmul over the patch's flattened pixels
        self.patch_embed = LinearBase(spec.patch_features, spec.embed_dim, bias=False)
        self.blocks = nn.ModuleList([VisionBlock(spec) for _ in range(spec.depth)])
        self.merger = PatchMerger(spec)
        quarter = spec.embed_dim // spec.num_heads // 4  # frequencies per axis: rows, then columns
        inv_freq = 1.0 / (spec.rope_theta ** (torch.arange(0, 2 * quarter, 2, dtype=torch.float32) / (2 * quarter)))
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def layout(self, grids: list[tuple[int, int, int]], device) -> Layout:
        spec, m = self.spec, self.spec.merge_size
        rows, cols, full_lens = [], [], []
        for t, h, w in grids:
            if h % m or w % m:
                raise ValueError(f"image grid {h}x{w} patches is not a multiple of the merge size {m}")
            # block-major: (h/m, w/m, m, m)
            r = torch.arange(h).view(h // m, m, 1, 1).expand(h // m, m, w // m, m).permute(0, 2, 1, 3).flatten()
            c = torch.arange(w).view(1, 1, w // m, m).expand(h // m, m, w // m, m).permute(0, 2, 1, 3).flatten()
            rows.append(r.repeat(t))
            cols.append(c.repeat(t))
            full_lens += [h * w] * t
        angles = torch.cat([torch.cat(rows)[:, None] * self.inv_freq.cpu(),
                            torch.cat(cols)[:, None] * self.inv_freq.cpu()], dim=-1)  # (N, d / 2)
        table = torch.cat([angles.cos(), angles.sin()], dim=-1)
        if not spec.window_size:
            return Layout(table.to(device), _grouped(full_lens, device), [], None, None)
        order, window_lens = self._windows(grids)
        unit = m * m
        patch_order = (order[:, None] * unit + torch.arange(unit)).flatten()
        return Layout(table[patch_order].to(device), _grouped(full_lens, device),
                      _grouped(window_lens, device), patch_order.to(device), torch.argsort(order).to(device))

    def _windows(self, grids) -> tuple[torch.Tensor, list[int]]:
        """Qwen2.5-VL's windows: each frame's merged grid cut into squares of window_size pixels (the last row and
        column of windows cut short); the merged units in window order, and each window's length in patches."""
        spec, m = self.spec, self.spec.merge_size
        side = spec.window_size // m // spec.patch_size  # merged units per window side
        order, lens, base = [], [], 0
        for t, h, w in grids:
            gh, gw = h // m, w // m
            units = torch.arange(t * gh * gw).view(t, gh, gw)
            for f in range(t):
                for r0 in range(0, gh, side):
                    for c0 in range(0, gw, side):
                        win = units[f, r0:r0 + side, c0:c0 + side].flatten()
                        order.append(win + base)
                        lens.append(win.numel() * m * m)
            base += t * gh * gw
        return torch.cat(order), lens

    def forward(self, patches: torch.Tensor, grids: list[tuple[int, int, int]]) -> torch.Tensor:
        spec = self.spec
        if patches.dim() != 2 or patches.shape[1] != spec.patch_features:
            raise ValueError(f"expected patch rows (N, {spec.patch_features}), got {tuple(patches.shape)}")
        if patches.shape[0] != sum(t * h * w for t, h, w in grids):
            raise ValueError(f"{patches.shape[0]} patch rows for grids {grids}")
        lay = self.layout(grids, patches.device)
        x = self.patch_embed(patches.to(self.patch_embed.dtype))
        if lay.order is not None:
            x = x.index_select(0, lay.order)
        rows = torch.arange(x.shape[0], device=x.device)
        for i, blk in enumerate(self.blocks):
            full = not spec.window_size or i in spec.full_attention_blocks
            x = blk(x, rows, lay.table, lay.full if full else lay.windowed)
        merged = self.merger(x)
        return merged if lay.merged_order is None else merged.index_select(0, lay.merged_order)

    def load_weights(self, weights) -> set[str]:
        """Checkpoint tensors named below "visual." (HF names without that prefix) into the parameters; returns
        the parameter names filled."""
        params = dict(self.named_parameters())
        loaded = set()
        for name, tensor in weights:
            shard = None
            if ".mlp.gate_proj." in name or ".mlp.up_proj." in name:
                shard = 0 if ".gate_proj." in name else 1
                name = name.replace(".gate_proj.", ".gate_up_proj.").replace(".up_proj.", ".gate_up_proj.")
            t = tensor if isinstance(tensor, torch.Tensor) else tensor.read()
            if name == "patch_embed.proj.weight":
                name, t = "patch_embed.weight", t.reshape(t.shape[0], -1)  # (E, C, T, P, P) -> (E, C * T * P * P)
            if name not in params:
                raise ValueError(f"checkpoint tensor 'visual.{name}' has no matching parameter in the vision tower")
            param = params[name]
            owner = self.get_submodule(name.rsplit(".", 1)[0])
            if isinstance(owner, LinearBase):
                owner.weight_loader(param, t, shard)
            else:
                if tuple(param.shape) != tuple(t.shape):
                    raise ValueError(f"shape mismatch for visual.{name}: {tuple(param.shape)} vs {tuple(t.shape)}")
                param.data.copy_(t)
            loaded.add(name)
        return loaded
