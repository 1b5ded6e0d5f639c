"""KServe v2 tensors over HTTP: the JSON form (`data` as a flat or nested list) and Triton's binary tensor
extension (a JSON header of `Inference-Header-Content-Length` bytes, then each tensor's bytes in order;
BYTES elements as a 4-byte little-endian length and the bytes), read and written."""

from __future__ import annotations

import struct
from typing import Any

import numpy as np
import orjson

from radixgen.common.http_errors import bad_request

HEADER_LENGTH = "inference-header-content-length"
NUMPY_TYPES = {"BOOL": np.bool_, "INT8": np.int8, "INT16": np.int16, "INT32": np.int32, "INT64": np.int64,
               "UINT8": np.uint8, "UINT16": np.uint16, "UINT32": np.uint32, "UINT64": np.uint64,
               "FP16": np.float16, "FP32": np.float32, "FP64": np.float64}
MAX_ELEMENTS = 4096  # a request's tensors hold prompts and a few parameters, never more


def _flat(data: Any, where: str) -> list[Any]:
    out: list[Any] = []
    stack = [data]
    while stack:  # iterative: a deeply nested list must not reach the recursion limit
        x = stack.pop()
        if isinstance(x, list):
            stack.extend(reversed(x))
        else:
            out.append(x)
        if len(out) + len(stack) > MAX_ELEMENTS:
            raise bad_request(f"{where}: more than {MAX_ELEMENTS} elements")
    return out


def _bytes_elements(raw: bytes, where: str) -> list[bytes]:
    out, i = [], 0
    while i < len(raw):
        if i + 4 > len(raw):
            raise bad_request(f"{where}: truncated BYTES element length")
        (n,) = struct.unpack_from("<I", raw, i)
        if i + 4 + n > len(raw):
            raise bad_request(f"{where}: a BYTES element runs past the tensor's data")
        out.append(raw[i + 4:i + 4 + n])
        i += 4 + n
    return out


def _text(x: Any, where: str) -> str:
    if isinstance(x, bytes):
        try:
            return x.decode("utf-8")
        except UnicodeDecodeError:
            raise bad_request(f"{where}: not UTF-8 text") from None
    if not isinstance(x, str):
        raise bad_request(f"{where}: BYTES elements are strings, got {type(x).__name__}")
    return x


def read_request(body: bytes, header_length: str | None) -> tuple[dict[str, Any], dict[str, tuple[list[int], list]]]:
    """The request's JSON and its inputs: name -> (shape, flat elements; BYTES as str)."""
    binary = b""
    if header_length is not None:
        if not header_length.isdigit() or int(header_length) > len(body):
            raise bad_request(f"Inference-Header-Content-Length: {header_length!r} is not a length within the body")
        body, binary = body[:int(header_length)], body[int(header_length):]
    try:
        req = orjson.loads(body)
    except orjson.JSONDecodeError as e:
        raise bad_request(f"the request body is not valid JSON: {e}") from None
    if not isinstance(req, dict) or not isinstance(req.get("inputs"), list):
        raise bad_request("inputs: required (a list of tensors)")
    inputs: dict[str, tuple[list[int], list]] = {}
    offset = 0
    for k, t in enumerate(req["inputs"]):
        where = f"inputs[{k}]"
        if not isinstance(t, dict) or not isinstance(t.get("name"), str):
            raise bad_request(f"{where}: a tensor object with a name")
        name, dtype, shape = t["name"], t.get("datatype"), t.get("shape")
        where = f"input '{name}'"
        if dtype != "BYTES" and dtype not in NUMPY_TYPES:
            raise bad_request(f"{where}: unknown datatype {dtype!r}")
        if not isinstance(shape, list) or not all(isinstance(d, int) and d >= 0 for d in shape):
            raise bad_request(f"{where}: shape must be a list of non-negative integers")
        size = (t.get("parameters") or {}).get("binary_data_size")
        if size is not None:
            if not isinstance(size, int) or size < 0 or offset + size > len(binary):
                raise bad_request(f"{where}: binary_data_size {size!r} runs past the body")
            raw = binary[offset:offset + size]
            offset += size
            if dtype == "BYTES":
                data: list = _bytes_elements(raw, where)
            else:
                item = np.dtype(NUMPY_TYPES[dtype]).itemsize
                if len(raw) % item:
                    raise bad_request(f"{where}: {len(raw)} bytes is not a whole number of {dtype} elements")
                data = np.frombuffer(raw, dtype=NUMPY_TYPES[dtype]).tolist()
        elif "data" in t:
            data = _flat(t["data"], where)
        else:
            raise bad_request(f"{where}: no data (neither `data` nor binary_data_size)")
        if dtype == "BYTES":
            data = [_text(x, where) for x in data]
        if int(np.prod(shape)) != len(data):
            raise bad_request(f"{where}: shape {shape} holds {int(np.prod(shape))} elements, data has {len(data)}")
        if name in inputs:
            raise bad_request(f"{where}: given twice")
        inputs[name] = (shape, data)
    return req, inputs


def write_response(head: dict[str, Any], outputs: list[tuple[str, str, list[int], list]],
                   binary: set[str]) -> tuple[bytes, dict[str, str]]:
    """The response body and its headers: outputs (name, datatype, shape, flat data); those named in `binary`
    are sent as binary data after the JSON header."""
    tensors, blobs = [], []
    for name, dtype, shape, data in outputs:
        t: dict[str, Any] = {"name": name, "datatype": dtype, "shape": shape}
        if name in binary:
            if dtype == "BYTES":
                blob = b"".join(struct.pack("<I", len(b)) + b for b in (s.encode() for s in data))
            else:
                blob = np.asarray(data, dtype=NUMPY_TYPES[dtype]).tobytes()
            t["parameters"] = {"binary_data_size": len(blob)}
            blobs.append(blob)
        else:
            t["data"] = data
        tensors.append(t)
    header = orjson.dumps({**head, "outputs": tensors})
    if not blobs:
        return header, {"content-type": "application/json"}
    return header + b"".join(blobs), {"content-type": "application/octet-stream",
                                      HEADER_LENGTH: str(len(header))}
