"""A GGUF file's metadata and tensor index read straight from its memory map, for loading weights: the fields'
scalar and string values, arrays (a tokenizer's 100k+ strings) only skipped over and decoded when asked for, and
each tensor's data as a numpy view of the copy-on-write map (the gguf package's GGUFReader builds an object per
array item first: seconds for a tokenizer, while loading needs none of it). Tensors are as GGUFReader gives them:
`name`, `tensor_type`, `shape` (the file's dims, innermost first), `n_bytes`, `data` (F32 / F16 as their dtype,
every other type as uint8 rows of blocks)."""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_NUMPY = {0: np.uint8, 1: np.int8, 2: np.uint16, 3: np.int16, 4: np.uint32, 5: np.int32, 6: np.float32, 7: np.bool_,
          10: np.uint64, 11: np.int64, 12: np.float64}
_STRING, _ARRAY = 8, 9


class GGUFIndexError(ValueError):
    """A file that is not a GGUF this reader understands."""


@dataclass
class Field:
    """One metadata value: `contents()` decodes it (an array on demand)."""

    _buf: memoryview
    _type: int
    _at: int
    _count: int = 0
    _elem: int = 0

    def contents(self):
        if self._type != _ARRAY:
            return _value(self._buf, self._type, self._at)[0]
        if self._elem in _NUMPY:
            return np.frombuffer(self._buf, _NUMPY[self._elem], self._count, self._at).tolist()
        out, at = [], self._at
        for _ in range(self._count):
            v, at = _value(self._buf, self._elem, at)
            out.append(v)
        return out


@dataclass
class Tensor:
    name: str
    tensor_type: object  # gguf.GGMLQuantizationType
    shape: np.ndarray
    n_bytes: int
    data: np.ndarray


def _value(buf: memoryview, t: int, at: int):
    """(value, offset past it) of a scalar or string at `at`."""
    if t == _STRING:
        (n,) = struct.unpack_from("<Q", buf, at)
        return bytes(buf[at + 8:at + 8 + n]).decode("utf-8", errors="replace"), at + 8 + n
    fmt = _SCALARS.get(t)
    if fmt is None:
        raise GGUFIndexError(f"unknown GGUF value type {t}")
    return struct.unpack_from(fmt, buf, at)[0], at + struct.calcsize(fmt)


def _skip(buf: memoryview, t: int, at: int, count: int) -> int:
    if t in _NUMPY:
        return at + count * np.dtype(_NUMPY[t]).itemsize
    if t == _STRING:
        for _ in range(count):
            at += 8 + struct.unpack_from("<Q", buf, at)[0]
        return at
    if t == _ARRAY:
        for _ in range(count):
            elem, n = struct.unpack_from("<IQ", buf, at)
            at = _skip(buf, elem, at + 12, n)
        return at
    raise GGUFIndexError(f"unknown GGUF value type {t}")


class GGUFIndex:
    """`fields` (key -> Field) and `tensors` of a GGUF file (version 2 or 3, little-endian)."""

    def __init__(self, path: str | Path) -> None:
        self.data = np.memmap(path, mode="c")
        try:
            self._parse(path)
        except (struct.error, ValueError) as e:  # a read past the end, a view past it, an unknown tensor type
            if isinstance(e, GGUFIndexError):
                raise
            raise GGUFIndexError(f"{path} is cut short or corrupt: {e}") from e

    def _parse(self, path) -> None:
        import gguf

        buf = memoryview(self.data).cast("B")
        if len(buf) < 24 or bytes(buf[:4]) != b"GGUF":
            raise GGUFIndexError(f"{path} is not a GGUF file")
        version, n_tensors, n_kv = struct.unpack_from("<IQQ", buf, 4)
        if version not in (2, 3):
            raise GGUFIndexError(f"{path}: GGUF version {version} is not read here")
        at, self.fields = 24, {}
        for _ in range(n_kv):
            key, at = _value(buf, _STRING, at)
            (t,) = struct.unpack_from("<I", buf, at)
            at += 4
            if t == _ARRAY:
                elem, count = struct.unpack_from("<IQ", buf, at)
                self.fields[key] = Field(buf, t, at + 12, count, elem)
                at = _skip(buf, elem, at + 12, count)
            else:
                self.fields[key] = Field(buf, t, at)
                at = _skip(buf, t, at, 1)
        infos = []
        for _ in range(n_tensors):
            name, at = _value(buf, _STRING, at)
            (n_dims,) = struct.unpack_from("<I", buf, at)
            dims = struct.unpack_from(f"<{n_dims}Q", buf, at + 4)
            t, offset = struct.unpack_from("<IQ", buf, at + 4 + 8 * n_dims)
            at += 4 + 8 * n_dims + 12
            infos.append((name, dims, t, offset))
        align = int(self.fields["general.alignment"].contents()) if "general.alignment" in self.fields else 32
        start = -(-at // align) * align
        self.tensors = []
        for name, dims, t, offset in infos:
            qt = gguf.GGMLQuantizationType(t)
            block, size = gguf.GGML_QUANT_SIZES[qt]
            rows = tuple(int(d) for d in reversed(dims[1:]))
            if qt.name in ("F32", "F16"):
                dtype, inner = np.float32 if qt.name == "F32" else np.float16, int(dims[0])
                n_bytes = int(np.prod(dims)) * np.dtype(dtype).itemsize
            else:
                dtype, inner = np.uint8, int(dims[0]) // block * size
                n_bytes = int(np.prod(rows, dtype=np.int64)) * inner
            if start + offset + n_bytes > len(self.data):
                raise GGUFIndexError(f"{path}: tensor {name!r} runs past the end of the file")
            view = self.data[start + offset:start + offset + n_bytes].view(dtype).reshape(*rows, inner)
            self.tensors.append(Tensor(name, qt, np.array(dims, np.uint64), n_bytes, view))
