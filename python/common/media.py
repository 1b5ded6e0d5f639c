"""Image sources -> decoded images, shared by every front end (the DSL, the Engine, both HTTP APIs, offline).

A source is a `PIL.Image.Image`, raw bytes of an image file, a local path (a `str` or `os.PathLike`), a data URL
(`data:image/png;base64,...`), a bare base64 string, or an `http(s)://` URL, which is fetched only where the
caller allows remote media (`allow_remote=True`), with a size limit and a timeout. Every failure is a
`MediaError` (a ValueError) naming the problem: a malformed data URL, bytes no decoder reads, a missing file, a
refused or failed fetch. Decoding is Pillow's; the result is always an RGB image, fully loaded.

A source string from a network client is a `ClientSource` (the HTTP APIs wrap them): it is never read as a file
of the server's disk, unless it is an absolute path (or a file:// URL) under the folder the server allows
(`local_root`: --allowed-local-media-path); otherwise a client could read any image the server can, and learn
from the errors which files exist. Without that folder the decision is made from the string alone (no file is
looked at): a path-like string is refused, anything else is read as base64.
"""

from __future__ import annotations

import base64
import binascii
import io
import os
import re
from pathlib import Path
from typing import Any

DEFAULT_MAX_BYTES = 20 << 20
_DATA_URL = re.compile(r"data:(?P<mime>[\w.+-]+/[\w.+-]+)?(?P<params>(;[\w.+-]+=[\w.+-]+)*)(?P<b64>;base64)?,",
                       re.ASCII)
_BASE64 = re.compile(r"[A-Za-z0-9+/=\s_-]+")


class MediaError(ValueError):
    """An image source that cannot be read or decoded; the message names why."""


class ClientSource(str):
    """An image source string sent by a network client (see the module docstring)."""


def client_sources(data: Any) -> Any:
    """`image_data` (a source, or lists of them, None for none) with every string a ClientSource."""
    if isinstance(data, str):
        return ClientSource(data)
    if isinstance(data, (list, tuple)):
        return [client_sources(x) for x in data]
    return data


def is_url(source: Any) -> bool:
    return isinstance(source, str) and source[:8].lower().startswith(("http://", "https://"))


def source_bytes(source: Any, *, allow_remote: bool = False, max_bytes: int = DEFAULT_MAX_BYTES,
                 timeout_s: float = 10.0, local_root: str | None = None) -> bytes:
    """The encoded bytes of a source that is not a PIL image (see the module docstring)."""
    if isinstance(source, ClientSource) and not source.startswith("data:") and not is_url(source):
        path = _client_path(source, local_root)
        data = _base64_bytes(source, "image") if path is None else _read_file(path, max_bytes)
    elif isinstance(source, (bytes, bytearray, memoryview)):
        data = bytes(source)
    elif isinstance(source, os.PathLike):
        data = _read_file(Path(source), max_bytes)
    elif isinstance(source, str):
        if source.startswith("data:"):
            data = _data_url_bytes(source)
        elif is_url(source):
            if not allow_remote:
                raise MediaError("image: http(s) URLs are not fetched on this server (start it with "
                                 "--allow-remote-media), send the image as a data URL or base64")
            data = fetch(source, max_bytes, timeout_s)
        elif len(source) < 4096 and ("/" in source or "." in source) and Path(source).is_file():
            data = _read_file(Path(source), max_bytes)
        else:
            data = _base64_bytes(source, "image")
    else:
        raise MediaError(f"image: expected a path, bytes, a data URL, base64 text or a PIL image, got "
                         f"{type(source).__name__}")
    if len(data) > max_bytes:
        raise MediaError(f"image: {len(data)} bytes, more than the limit of {max_bytes}")
    if not data:
        raise MediaError("image: the image data is empty")
    return data


def load_image(source: Any, *, allow_remote: bool = False, max_bytes: int = DEFAULT_MAX_BYTES,
               timeout_s: float = 10.0, max_pixels: int | None = None, local_root: str | None = None):
    """The source as an RGB `PIL.Image.Image`; `max_pixels`: width * height above it is a MediaError (checked
    from the header, before the pixels are decoded); `local_root`: the folder a ClientSource path may name."""
    from PIL import Image, UnidentifiedImageError

    if isinstance(source, Image.Image):
        img = source
    else:
        data = source_bytes(source, allow_remote=allow_remote, max_bytes=max_bytes, timeout_s=timeout_s,
                            local_root=local_root)
        try:
            img = Image.open(io.BytesIO(data))
        except UnidentifiedImageError:
            raise MediaError(f"image: cannot decode the image data ({len(data)} bytes): not an image format "
                             f"that can be read (PNG, JPEG, GIF, BMP, WebP...)") from None
        except (OSError, ValueError, Image.DecompressionBombError) as e:
            raise MediaError(f"image: cannot decode the image data ({len(data)} bytes): "
                             f"{type(e).__name__}: {e}") from None
    w, h = img.size
    if max_pixels is not None and w * h > max_pixels:
        raise MediaError(f"image: {w}x{h} = {w * h} pixels, more than the limit of {max_pixels} "
                         f"(--max-image-pixels)")
    if w < 1 or h < 1:
        raise MediaError(f"image: empty image ({w}x{h})")
    try:
        img.load()
        return img if img.mode == "RGB" else img.convert("RGB")
    except (OSError, ValueError, Image.DecompressionBombError) as e:
        raise MediaError(f"image: cannot decode the image data: {type(e).__name__}: {e}") from None


def to_data_url(source: Any, fmt: str = "PNG") -> str:
    """A data URL of the source, to send it to a server (a URL is sent as it is, for the server to fetch)."""
    if is_url(source) or (isinstance(source, str) and source.startswith("data:")):
        return source
    from PIL import Image

    if isinstance(source, Image.Image):
        buf = io.BytesIO()
        source.save(buf, format=fmt)
        data, mime = buf.getvalue(), f"image/{fmt.lower()}"
    else:
        data = source_bytes(source)
        mime = "application/octet-stream"  # what no image header names (the server says why it cannot decode it)
        try:
            with Image.open(io.BytesIO(data)) as img:  # reads the header only
                if img.format:
                    mime = Image.MIME.get(img.format, f"image/{img.format.lower()}")
        except Exception:  # noqa: BLE001 - any unreadable header keeps the generic type
            pass
    return f"data:{mime};base64,{base64.b64encode(data).decode()}"


def fetch(url: str, max_bytes: int, timeout_s: float) -> bytes:
    """GET an http(s) URL: at most `max_bytes` read, `timeout_s` for the whole transfer."""
    import httpx

    try:
        with httpx.Client(timeout=timeout_s, follow_redirects=True, max_redirects=3) as client, \
                client.stream("GET", url) as resp:
            if resp.status_code != 200:
                raise MediaError(f"image: fetching {url[:200]} answered HTTP {resp.status_code}")
            chunks, total = [], 0
            for chunk in resp.iter_bytes():
                total += len(chunk)
                if total > max_bytes:
                    raise MediaError(f"image: {url[:200]} is larger than the limit of {max_bytes} bytes")
                chunks.append(chunk)
            return b"".join(chunks)
    except httpx.HTTPError as e:
        raise MediaError(f"image: fetching {url[:200]} failed: {type(e).__name__}: {e}") from None


def _client_path(source: str, local_root: str | None) -> Path | None:
    """The file a client's source names (None: it is base64), decided from the string; a MediaError for a path
    the server does not read. base64 has no "." and no ":", so a string with either and a leading "/" (or a
    file:// URL) is a path; a bare "/9j/4AAQ..." (a JPEG's base64) is not."""
    text = source[len("file://"):] if source.startswith("file://") else None
    if text is None:
        if not source.startswith("/") or _BASE64.fullmatch(source):
            return None
        text = source
    if local_root is None:
        raise MediaError("image: local file paths are not read on this server (start it with "
                         "--allowed-local-media-path DIR); send the image as a data URL or base64")
    root = os.path.realpath(local_root)
    path = os.path.realpath(text)
    if os.path.commonpath([root, path]) != root:
        raise MediaError("image: the path is outside the folder this server reads images from "
                         "(--allowed-local-media-path)")
    return Path(path)


def _read_file(path: Path, max_bytes: int) -> bytes:
    try:
        size = path.stat().st_size
        if size > max_bytes:
            raise MediaError(f"image: {path} is {size} bytes, more than the limit of {max_bytes}")
        return path.read_bytes()
    except OSError as e:
        raise MediaError(f"image: cannot read {path}: {e.strerror or e}") from None


def _data_url_bytes(url: str) -> bytes:
    m = _DATA_URL.match(url)
    if m is None:
        raise MediaError("image: malformed data URL (expected data:<mime>;base64,<data>)")
    if m.group("mime") and not m.group("mime").startswith("image/") and m.group("mime") != "application/octet-stream":
        raise MediaError(f"image: the data URL's media type {m.group('mime')!r} is not an image type")
    if not m.group("b64"):
        raise MediaError("image: a data URL must be base64-encoded (data:<mime>;base64,<data>)")
    return _base64_bytes(url[m.end():], "the data URL's")


def _base64_bytes(text: str, what: str) -> bytes:
    if not text or not _BASE64.fullmatch(text):
        raise MediaError(f"image: {what} data is neither a file path, a URL nor valid base64")
    try:
        return base64.b64decode(text.replace("-", "+").replace("_", "/"), validate=False)
    except (binascii.Error, ValueError) as e:
        raise MediaError(f"image: {what} base64 data does not decode: {e}") from None
