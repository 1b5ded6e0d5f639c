"""Filling a model's parameters from its files (runtime/loader.py resolved them to a folder): safetensors read
shard by shard, a native GGUF folder's blocks, or seeded dummy values."""

from __future__ import annotations

import json
import struct
from collections.abc import Iterator
from pathlib import Path

import torch

from radixgen.runtime.executor.gguf_index import GGUFIndex
from radixgen.runtime.gguf_arch import stored_norm_offset
from radixgen.runtime.loader import (
    GGUF_SOURCE,
    ModelLoadError,
    gguf_mapping,
    is_gguf_native,
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


def _progress(tensors, path: Path):
    """The tensors, with a bar on stderr when it is a terminal and the load takes over two seconds."""
    import sys

    from tqdm import tqdm

    return tqdm(tensors, desc=f"loading {path.name}", unit="tensor", leave=False, delay=2.0, file=sys.stderr,
                disable=not sys.stderr.isatty())


def iter_gguf_native(folder: Path) -> Iterator[tuple[str, torch.Tensor]]:
    """The tensors of a native folder's GGUF file, memory-mapped: matmul weights as GGUFTensors (their blocks as
    views of the map, rows in our order: Q and K reordered in a copy; an expert block's stacks as GGUFStacks),
    everything else (norms, biases, an untied embedding) dequantized to float32."""
    from radixgen.runtime.layers.quantization.gguf import GGUFStack, GGUFTensor

    path = Path(json.loads((folder / GGUF_SOURCE).read_text())["path"])
    if not path.is_file():
        raise ModelLoadError(f"the GGUF file of {folder} is gone: {path}")
    try:
        reader = GGUFIndex(path)  # the fields' values and the tensors' views of the map, parsed in milliseconds
    except (ValueError, KeyError, struct.error) as e:  # GGUFIndexError, a cut file, an unknown tensor type
        raise ModelLoadError(f"corrupt GGUF file {path}: {e}") from e
    arch = reader.fields["general.architecture"].contents()

    def meta(key: str, default=None):
        f = reader.fields.get(f"{arch}.{key}")
        return default if f is None else f.contents()

    mapping = gguf_mapping(arch, reader)
    tied = not any(t.name == "output.weight" for t in reader.tensors)
    for t in _progress(reader.tensors, path):
        hf_name = mapping.hf_name(t.name)
        if hf_name is None:
            continue
        raw = torch.from_numpy(t.data)  # a view of the file's map: the kernels that read blocks as stored keep it
        if raw.dim() == 1:  # a vector (norm, bias): float in every GGUF we read
            yield hf_name, raw.float() - stored_norm_offset(arch, t.name)
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


def release_gguf_pages(model: torch.nn.Module, folder: Path) -> int:
    """After the linear methods laid a native GGUF folder's weights out: drop from this process the mapped pages
    of the file that no tensor of `model` still reads (a block layout copied them, or they were dequantized), so
    resident memory holds the file's bytes once, not beside their copies. The map is copy-on-write and those
    pages were never written: were one read again it would come back from the file. Returns the bytes released."""
    import ctypes

    path = str(Path(json.loads((folder / GGUF_SOURCE).read_text())["path"]).resolve())
    maps = []
    with open("/proc/self/maps") as f:
        for line in f:
            fields = line.split(maxsplit=5)
            if len(fields) == 6 and fields[5].strip() == path:
                lo, hi = (int(v, 16) for v in fields[0].split("-"))
                maps.append((lo, hi))
    if not maps:
        return 0
    kept = []
    for t in _model_tensors(model):
        if t.numel() and t.device.type == "cpu" and t.layout == torch.strided:  # (oneDNN's packed: no file view)
            s = t.untyped_storage()
            kept.append((s.data_ptr(), s.data_ptr() + s.nbytes()))
    page = 4096
    madvise = ctypes.CDLL(None, use_errno=True).madvise
    madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    released = 0
    for lo, hi in maps:
        holes, at = [], lo
        for a, b in sorted(k for k in kept if k[1] > lo and k[0] < hi):
            if a > at:
                holes.append((at, a))
            at = max(at, b)
        holes.append((at, hi))
        for a, b in holes:
            a, b = -(-a // page) * page, b // page * page  # whole pages only
            if b > a and madvise(a, b - a, 4) == 0:  # MADV_DONTNEED
                released += b - a
    return released


def _model_tensors(model: torch.nn.Module) -> Iterator[torch.Tensor]:
    """The tensors `model` holds: parameters, buffers, and tensors its modules keep in attributes (directly, in
    lists or lists of lists, or as the `data` of the weight objects of the C layouts)."""
    yield from model.parameters()
    yield from model.buffers()

    def items(v):
        if isinstance(v, (list, tuple)):
            for x in v:
                yield from items(x)
        else:
            yield v

    for m in model.modules():
        for v in vars(m).values():
            for item in items(v):
                if isinstance(item, torch.Tensor):
                    yield item
                else:
                    for w in vars(item).values() if hasattr(item, "__dict__") and not isinstance(
                            item, torch.nn.Module) else ():
                        if isinstance(w, torch.Tensor):
                            yield w
