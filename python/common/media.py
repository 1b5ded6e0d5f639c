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
import http.client
import io
import os
import re
import time
import urllib.parse
import zlib
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
    if getattr(img, "format", None) == "PNG" and not isinstance(source, Image.Image):
        _check_png_rows(data, w, h)  # before the pixels are allocated: Pillow fills missing rows silently
    try:
        img.load()
        return img if img.mode == "RGB" else img.convert("RGB")
    except (OSError, ValueError, Image.DecompressionBombError) as e:
        raise MediaError(f"image: cannot decode the image data: {type(e).__name__}: {e}") from None


_ADAM7 = ((0, 0, 8, 8), (4, 0, 8, 8), (0, 4, 4, 8), (2, 0, 4, 4), (0, 2, 2, 4), (1, 0, 2, 2), (0, 1, 1, 2))
_PNG_CHANNELS = {0: 1, 2: 3, 3: 1, 4: 2, 6: 4}  # by colour type


def _check_png_rows(data: bytes, w: int, h: int) -> None:
    """A MediaError unless the PNG's compressed rows hold every row its header's w x h needs (Pillow fills
    what is missing: a 4000x4000 header over three rows would cost 48 MB of pixels from a few bytes). The
    rows are inflated to count them, never kept."""
    pos, idat, ihdr = 8, [], None
    while pos + 8 <= len(data):
        length, kind = int.from_bytes(data[pos:pos + 4], "big"), data[pos + 4:pos + 8]
        body = data[pos + 8:pos + 8 + length]
        if kind == b"IHDR":
            ihdr = body
        elif kind == b"IDAT":
            idat.append(body)
        elif kind == b"IEND":
            break
        pos += 12 + length
    if ihdr is None or len(ihdr) < 13:
        raise MediaError("image: the PNG has no valid IHDR chunk")
    depth, colour, interlaced = ihdr[8], ihdr[9], ihdr[12] == 1
    bits = depth * _PNG_CHANNELS.get(colour, 4)
    passes = _ADAM7 if interlaced else ((0, 0, 1, 1),)
    needed = 0
    for x0, y0, dx, dy in passes:
        cols, rows = -(-(w - x0) // dx), -(-(h - y0) // dy)
        if cols > 0 and rows > 0:
            needed += rows * (1 + -(-cols * bits // 8))  # a filter byte, then the row's packed samples
    inflate, got = zlib.decompressobj(), 0
    try:
        for part in idat:
            while part and got < needed:
                got += len(inflate.decompress(part, min(needed - got, 1 << 20)))
                part = inflate.unconsumed_tail
            if got >= needed:
                return
    except zlib.error as e:
        raise MediaError(f"image: the PNG's image data does not inflate: {e}") from None
    if got < needed:
        raise MediaError(f"image: truncated PNG: its data holds {got} of the {needed} bytes of rows that its "
                         f"header's {w}x{h} needs")


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


MAX_REDIRECTS = 3


def fetch(url: str, max_bytes: int, timeout_s: float) -> bytes:
    """GET an http(s) URL: at most `max_bytes`, and `timeout_s` for the whole fetch (connecting, every
    redirect, the headers and every byte), however the peer paces it. Each socket wait is given only what
    is left of the deadline, and each read takes what has arrived (a trickle cannot stretch a read). A
    declared Content-Length over the limit is refused before the body is read; a body longer than it
    says is cut at the limit, a shorter one is an error."""
    deadline = time.monotonic() + timeout_s
    shown = url[:200]
    try:
        for _ in range(MAX_REDIRECTS + 1):
            conn, sock, resp = _open(url, deadline)
            try:
                if resp.status in (301, 302, 303, 307, 308):
                    location = resp.getheader("Location") or ""
                    url = urllib.parse.urljoin(url, location)
                    if not is_url(url):
                        raise MediaError(f"image: fetching {shown} redirected to a URL that is not http(s)")
                    continue
                if resp.status != 200:
                    raise MediaError(f"image: fetching {shown} answered HTTP {resp.status}")
                return _read_body(sock, resp, shown, deadline, max_bytes)
            finally:
                resp.close()
                conn.close()
        raise MediaError(f"image: fetching {shown} redirected more than {MAX_REDIRECTS} times")
    except (OSError, http.client.HTTPException) as e:
        if _left(deadline) <= 0 or isinstance(e, TimeoutError):
            raise MediaError(f"image: fetching {shown} took longer than the limit of {timeout_s:g} s "
                             f"(--media-fetch-timeout-s)") from None
        raise MediaError(f"image: fetching {shown} failed: {type(e).__name__}: {e}") from None


def _left(deadline: float) -> float:
    return deadline - time.monotonic()


def _open(url: str, deadline: float):
    parts = urllib.parse.urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise MediaError(f"image: {url[:200]} is not an http(s) URL")
    left = _left(deadline)
    if left <= 0:
        raise TimeoutError
    kind = http.client.HTTPSConnection if parts.scheme == "https" else http.client.HTTPConnection
    conn = kind(parts.hostname, parts.port, timeout=left)
    try:
        target = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
        conn.request("GET", target, headers={"Accept": "image/*", "User-Agent": "radixgen"})
        sock = conn.sock  # kept: a response that closes the connection takes it off `conn`
        sock.settimeout(max(_left(deadline), 0.001))  # the headers wait on what is left
        return conn, sock, conn.getresponse()
    except BaseException:
        conn.close()
        raise


def _read_body(sock, resp, shown: str, deadline: float, max_bytes: int) -> bytes:
    declared = resp.getheader("Content-Length")
    if declared is not None and declared.strip().isdigit() and int(declared) > max_bytes:
        raise MediaError(f"image: {shown} is larger than the limit of {max_bytes} bytes (its Content-Length says "
                         f"{int(declared)})")
    chunks, total = [], 0
    while True:
        left = _left(deadline)
        if left <= 0:
            raise TimeoutError
        sock.settimeout(left)
        chunk = resp.read1(min(1 << 16, max_bytes + 1 - total))
        if not chunk:
            if declared is not None and declared.strip().isdigit() and total < int(declared):
                raise MediaError(f"image: {shown} ended after {total} of the {int(declared)} bytes its "
                                 f"Content-Length declares")
            return b"".join(chunks)
        total += len(chunk)
        if total > max_bytes:
            raise MediaError(f"image: {shown} is larger than the limit of {max_bytes} bytes")
        chunks.append(chunk)


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
