"""The CLIP vision tower (ViT): patch embedding, a class token, learned positions, pre-norm encoder layers with
full (non-causal) attention within each image. Its linear layers are ours (layers/linear.py), so they take the
device's linear method (the C matmuls on the CPU); attention and LayerNorm are torch's (one image's tokens
attend to each other once, with no KV cache to page).

Only the layers up to the deepest one the model reads are built (LLaVA reads the second to last by default);
`forward` returns the hidden states after each of those layers, index 0 being the embeddings after the pre-norm,
as Hugging Face's `hidden_states` are numbered.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from radixgen.runtime.layers.linear import ColumnParallelLinear, MergedColumnParallelLinear


def activation(name: str):
    if name == "quick_gelu":
        return lambda x: x * torch.sigmoid(1.702 * x)
    if name in ("gelu", "gelu_python"):
        return F.gelu
    if name in ("gelu_new", "gelu_pytorch_tanh", "gelu_fast"):
        return lambda x: F.gelu(x, approximate="tanh")
    raise ValueError(f"unsupported vision activation {name!r} (supported: quick_gelu, gelu, gelu_pytorch_tanh)")


class CLIPAttention(nn.Module):
    def __init__(self, hidden: int, num_heads: int) -> None:
        super().__init__()
        self.num_heads, self.head_dim = num_heads, hidden // num_heads
        self.qkv_proj = MergedColumnParallelLinear(hidden, [hidden] * 3, bias=True)
        self.out_proj = ColumnParallelLinear(hidden, hidden, bias=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, h = x.shape
        qkv = self.qkv_proj(x.reshape(b * n, h)).view(b, n, 3, self.num_heads, self.head_dim)
        q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0)  # (B, H, N, D) each
        o = F.scaled_dot_product_attention(q, k, v)  # scale D^-0.5, every token sees every other of its image
        return self.out_proj(o.transpose(1, 2).reshape(b * n, h)).view(b, n, h)


class CLIPEncoderLayer(nn.Module):
    def __init__(self, vc: dict) -> None:
        super().__init__()
        h, eps = vc["hidden_size"], vc.get("layer_norm_eps", 1e-5)
        self.layer_norm1 = nn.LayerNorm(h, eps=eps)
        self.self_attn = CLIPAttention(h, vc["num_attention_heads"])
        self.layer_norm2 = nn.LayerNorm(h, eps=eps)
        self.fc1 = ColumnParallelLinear(h, vc["intermediate_size"], bias=True)
        self.fc2 = ColumnParallelLinear(vc["intermediate_size"], h, bias=True)
        self.act = activation(vc.get("hidden_act", "quick_gelu"))

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, N, hidden)
        x = x + self.self_attn(self.layer_norm1(x))
        b, n, h = x.shape
        y = self.fc2(self.act(self.fc1(self.layer_norm2(x).reshape(b * n, h)))).view(b, n, h)
        return x + y


class CLIPVisionTower(nn.Module):
    """vc: the Hugging Face vision_config; num_layers: the encoder layers to build (those the model reads)."""

    def __init__(self, vc: dict, num_layers: int) -> None:
        super().__init__()
        h, p, size = vc["hidden_size"], vc["patch_size"], vc["image_size"]
        channels = vc.get("num_channels", 3)
        self.patch_size, self.image_size, self.hidden = p, size, h
        self.num_patches = (size // p) ** 2
        # the patch convolution (stride = kernel = p, no bias) as a matmul over flattened patches (c, ph, pw)
        self.patch_embedding = ColumnParallelLinear(channels * p * p, h, bias=False)
        self.class_embedding = nn.Parameter(torch.empty(h))
        self.position_embedding = nn.Parameter(torch.empty(self.num_patches + 1, h))
        self.pre_layrnorm = nn.LayerNorm(h, eps=vc.get("layer_norm_eps", 1e-5))
        self.layers = nn.ModuleList([CLIPEncoderLayer(vc) for _ in range(num_layers)])

    def patches(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """(B, C, H, W) -> (B, N, C * p * p), patches in row-major order, each flattened as (c, ph, pw)."""
        b, c, hh, ww = pixel_values.shape
        p = self.patch_size
        x = pixel_values.reshape(b, c, hh // p, p, ww // p, p).permute(0, 2, 4, 1, 3, 5)
        return x.reshape(b, (hh // p) * (ww // p), c * p * p)

    def forward(self, pixel_values: torch.Tensor) -> list[torch.Tensor]:
        """(B, C, H, W) -> the hidden states [embeddings, after layer 1, ...], each (B, 1 + N, hidden)."""
        b = pixel_values.shape[0]
        x = self.patches(pixel_values.to(self.class_embedding.dtype))
        n = x.shape[1]
        if n != self.num_patches:
            raise ValueError(f"the image has {n} patches, the vision tower takes {self.num_patches} "
                             f"({self.image_size}x{self.image_size} pixels)")
        x = self.patch_embedding(x.reshape(b * n, -1)).view(b, n, self.hidden)
        cls = self.class_embedding.view(1, 1, -1).expand(b, 1, -1)
        x = torch.cat([cls, x], dim=1) + self.position_embedding.unsqueeze(0)
        x = self.pre_layrnorm(x)
        states = [x]
        for layer in self.layers:
            x = layer(x)
            states.append(x)
        return states

    def load(self, name: str, tensor: torch.Tensor) -> bool:
        """One checkpoint tensor of the tower (its name after "vision_tower." and "vision_model."); False for one
        the tower does not use (the post-norm, the layers past the last one built)."""
        if name.startswith("encoder.layers."):
            idx, rest = name.removeprefix("encoder.layers.").split(".", 1)
            if int(idx) >= len(self.layers):
                return False
            layer = self.layers[int(idx)]
            for proj, shard in (("q_proj", 0), ("k_proj", 1), ("v_proj", 2)):
                if rest.startswith(f"self_attn.{proj}."):
                    param = getattr(layer.self_attn.qkv_proj, rest.rsplit(".", 1)[1])
                    layer.self_attn.qkv_proj.weight_loader(param, tensor, shard)
                    return True
            if rest.startswith("mlp."):
                rest = rest.removeprefix("mlp.")
            return _load_into(layer, rest, tensor)
        if name.startswith("post_layernorm."):
            return False
        if name.startswith("embeddings."):
            rest = name.removeprefix("embeddings.")
            if rest == "patch_embedding.weight":
                w = tensor if isinstance(tensor, torch.Tensor) else tensor.read()
                self.patch_embedding.weight_loader(self.patch_embedding.weight, w.reshape(w.shape[0], -1))
                return True
            if rest == "position_embedding.weight":
                return _copy(self.position_embedding, tensor)
            if rest == "class_embedding":
                return _copy(self.class_embedding, tensor)
            return False
        return _load_into(self, name, tensor)


def _read(tensor) -> torch.Tensor:
    return tensor if isinstance(tensor, torch.Tensor) else tensor.read()


def _copy(param: nn.Parameter, tensor) -> bool:
    t = _read(tensor)
    if tuple(param.shape) != tuple(t.shape):
        raise ValueError(f"shape mismatch: expected {tuple(param.shape)}, got {tuple(t.shape)}")
    param.data.copy_(t)
    return True


def _load_into(module: nn.Module, name: str, tensor) -> bool:
    """A tensor into the parameter `name` of `module` (a linear layer's through its weight loader)."""
    path, leaf = name.rsplit(".", 1)
    try:
        owner = module.get_submodule(path)
    except AttributeError:
        raise ValueError(f"vision tower: no module for checkpoint tensor {name!r}") from None
    param = getattr(owner, leaf, None)
    if not isinstance(param, nn.Parameter):
        raise ValueError(f"vision tower: no parameter for checkpoint tensor {name!r}")
    loader = getattr(param, "weight_loader", None)
    if loader is not None:
        loader(param, tensor)
        return True
    return _copy(param, tensor)
