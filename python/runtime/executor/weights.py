"""Filling a model's parameters from its files (runtime/loader.py resolved them to a folder): safetensors read
shard by shard, a native GGUF folder's blocks, or seeded dummy values."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import torch

from radixgen.runtime.loader import (
    GGUF_SOURCE,
    ModelLoadError,
    gguf_mapping,
    is_gguf_native,
    open_gguf,
    rope_heads,
    unpermute_rope,
)


class CheckpointSlice:
    """A checkpoint tensor not read yet: `narrow(dim, start, length)` reads only that part of the file
    (safetensors' get_slice), so a tensor-parallel rank reads its shard and never the whole tensor; `read()` reads
    it whole (a tensor that is not split, such as a scale of shape ()). Weight loaders call only `shape` and
    `narrow`, which a torch tensor has too, and `read` where they take the whole tensor (layers/linear.py)."""

    def __init__(self, part) -> None:
        self._part = part
        self.shape = tuple(part.get_shape())

    def narrow(self, dim: int, start: int, length: int) -> torch.Tensor:
        index = [slice(None)] * len(self.shape)
        index[dim] = slice(start, start + length)
        return self._part[tuple(index)]

    def read(self) -> torch.Tensor:
        return self._part[...]


def iter_safetensors(folder: Path) -> Iterator[tuple[str, CheckpointSlice]]:
    """Every tensor of the folder's safetensors files, by name, as a CheckpointSlice valid until the next."""
    from safetensors import SafetensorError
    from safetensors.torch import safe_open

    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"no *.safetensors files in {folder}")
    for f in files:
        try:
            with safe_open(str(f), framework="pt") as st:
                for name in st.keys():
                    yield name, CheckpointSlice(st.get_slice(name))
        except (SafetensorError, OSError) as e:
            raise ModelLoadError(f"corrupt safetensors file {f}: {e}") from e


def load_weights(model: torch.nn.Module, folder: Path, load_format: str = "auto", seed: int = 0,
                 quantized: str = "none") -> None:
    """Fill `model`'s parameters in place from `folder` (or with seeded random values for dummy). `quantized`: the
    weight format (layers.quantization), named in the error when the checkpoint's tensors do not fit it."""
    if load_format == "dummy":
        if quantized not in ("none", "int8", "int4", "fp8"):
            raise ModelLoadError(f"load_format dummy makes float weights; quantization {quantized!r} needs its "
                                 f"checkpoint")
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "norm" in name:
                    p.fill_(1.0)
                else:
                    gen = torch.Generator(p.device).manual_seed(seed + len(name))
                    p.normal_(0.0, 0.02, generator=gen)
        return
    tensors = iter_gguf_native(folder) if is_gguf_native(folder) else iter_safetensors(folder)
    try:
        model.load_weights(tensors)
    except ValueError as e:
        if quantized == "none" or isinstance(e, ModelLoadError):
            raise
        raise ModelLoadError(f"{e} (the checkpoint's tensors do not match quantization {quantized!r})") from e


def iter_gguf_native(folder: Path) -> Iterator[tuple[str, torch.Tensor]]:
    """The tensors of a native folder's GGUF file: matmul weights as GGUFTensors (their blocks, rows in our order;
    an expert block's stacks as GGUFStacks), everything else (norms, biases, an untied embedding) dequantized to
    float32."""
    from radixgen.runtime.layers.quantization.gguf import GGUFStack, GGUFTensor

    path = Path(json.loads((folder / GGUF_SOURCE).read_text())["path"])
    if not path.is_file():
        raise ModelLoadError(f"the GGUF file of {folder} is gone: {path}")
    reader, arch, meta = open_gguf(path)
    mapping = gguf_mapping(arch, reader)
    tied = not any(t.name == "output.weight" for t in reader.tensors)
    for t in reader.tensors:
        hf_name = mapping.hf_name(t.name)
        if hf_name is None:
            continue
        raw = torch.from_numpy(t.data.copy())
        if raw.dim() == 1:  # a vector (norm, bias): float in every GGUF we read
            yield hf_name, raw.float()
            continue
        heads = rope_heads(mapping, t.name, meta)
        if heads is not None:  # the permutation moves whole rows: it applies to the blocks as they are
            raw = unpermute_rope(raw, heads)
        if raw.dim() == 3:  # an expert stack (E, rows, row bytes): handed over in its blocks, dense otherwise
            g = GGUFStack(t.name, t.tensor_type.name, raw, int(t.shape[0]))
            yield hf_name, (g if mapping.is_gguf_matmul(t.name) else g.dense())
            continue
        g = GGUFTensor(t.name, t.tensor_type.name, raw, int(t.shape[0]))
        # handed over as stored: the matmul weights (and the embedding when it is the LM head's)
        if mapping.is_gguf_matmul(t.name) or t.name == "output.weight" or (tied and t.name == "token_embd.weight"):
            yield hf_name, g
        else:
            yield hf_name, g.dense()
