"""Image fetches from hostile http peers and images that lie about their size (issue 46 items 4 and 7): a local
threaded HTTP server on loopback trickles, stalls, redirects in a loop and lies about Content-Length; the
fetch is bounded as a whole by its timeout and by its byte limit while it streams. A PNG whose header claims
more rows than its data holds is refused before its pixels are allocated."""

from __future__ import annotations

import io
import struct
import sys
import threading
import time
import zlib
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tiny_vlm import make_image, png_bytes  # noqa: E402

from radixgen.common.media import MediaError, fetch, load_image  # noqa: E402

IMAGE = png_bytes(make_image(3, (16, 12)))
TRICKLE_S = 0.05  # between two bytes of a trickle: the whole image would take len(IMAGE) * this


class Peer(BaseHTTPRequestHandler):
    sent: dict[str, int] = {}  # path -> body bytes written before the client went away

    def log_message(self, *args) -> None:
        pass

    def _head(self, status: int = 200, length: int | None = None, **headers: str) -> None:
        self.send_response(status)
        if length is not None:
            self.send_header("Content-Length", str(length))
        for k, v in headers.items():
            self.send_header(k, v)
        self.end_headers()

    def do_GET(self) -> None:  # noqa: N802 - the http.server name
        path = self.path
        try:
            if path == "/ok":
                self._head(length=len(IMAGE))
                self.wfile.write(IMAGE)
            elif path == "/trickle":  # a valid image, one byte at a time: never idle long enough for a read timeout
                self._head(length=len(IMAGE))
                for i, b in enumerate(IMAGE):
                    self.wfile.write(bytes([b]))
                    self.wfile.flush()
                    Peer.sent[path] = i + 1
                    time.sleep(TRICKLE_S)
            elif path == "/stall-body":
                self._head(length=len(IMAGE))
                self.wfile.write(IMAGE[:10])
                self.wfile.flush()
                time.sleep(3)
            elif path == "/stall-headers":
                time.sleep(3)
            elif path == "/loop":
                self._head(302, length=0, Location="/loop")
            elif path == "/to-file":
                self._head(302, length=0, Location="file:///etc/hostname")
            elif path == "/claims-huge":
                self._head(length=10**12)
                self.wfile.write(IMAGE)
            elif path == "/claims-more":  # says 1000 bytes, sends 10, closes
                self._head(length=1000)
                self.wfile.write(IMAGE[:10])
            elif path == "/endless":  # no length, then more bytes than any limit
                self._head(**{"Content-Type": "image/png"})
                for _ in range(200):
                    self.wfile.write(b"\0" * 4096)
            else:
                self._head(404, length=0)
        except (BrokenPipeError, ConnectionResetError):
            pass  # the client gave up on us: what the test wants


@pytest.fixture(scope="module")
def peer():
    server = ThreadingHTTPServer(("127.0.0.1", 0), Peer)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def test_a_plain_fetch_works(peer):
    assert fetch(peer + "/ok", 1 << 20, 5.0) == IMAGE
    assert load_image(peer + "/ok", allow_remote=True).size == (16, 12)


def test_a_trickle_is_cut_at_the_whole_fetch_deadline(peer):
    """Each byte comes well within a read timeout; the whole image would take ~len(IMAGE) * 50 ms."""
    with pytest.raises(MediaError, match=r"took longer than the limit of 0\.5 s"):
        fetch(peer + "/trickle", 1 << 20, 0.5)
    assert Peer.sent["/trickle"] < len(IMAGE)


@pytest.mark.parametrize("path", ["/stall-body", "/stall-headers"])
def test_a_stall_is_cut_at_the_deadline(peer, path):
    with pytest.raises(MediaError, match=r"took longer than the limit of 0\.3 s"):
        fetch(peer + path, 1 << 20, 0.3)


@pytest.mark.parametrize("path,match", [
    ("/loop", r"redirected more than 3 times"),
    ("/to-file", r"redirected to a URL that is not http\(s\)"),
    ("/claims-huge", r"larger than the limit of 65536 bytes \(its Content-Length says 1000000000000\)"),
    ("/claims-more", r"ended after 10 of the 1000 bytes"),
    ("/endless", r"larger than the limit of 65536 bytes"),
    ("/missing", r"answered HTTP 404"),
])
def test_peers_that_lie_or_loop_get_a_clear_error(peer, path, match):
    with pytest.raises(MediaError, match=match):
        fetch(peer + path, 65536, 5.0)


def _chunk(kind: bytes, body: bytes) -> bytes:
    return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))


def _png(w: int, h: int, rows: bytes, interlace: int = 0) -> bytes:
    head = struct.pack(">IIBBBBB", w, h, 8, 2, 0, 0, interlace)  # 8-bit RGB
    return (b"\x89PNG\r\n\x1a\n" + _chunk(b"IHDR", head) + _chunk(b"IDAT", zlib.compress(rows))
            + _chunk(b"IEND", b""))


def test_a_png_with_fewer_rows_than_its_header_is_refused():
    w = h = 4000
    few_rows = b"".join(b"\0" + b"\x80" * (3 * w) for _ in range(3))
    with pytest.raises(MediaError, match=r"truncated PNG: .* 4000x4000"):
        load_image(_png(w, h, few_rows))
    whole = b"".join(b"\0" + bytes([y % 256]) * (3 * 7) for y in range(5))
    assert load_image(_png(7, 5, whole)).size == (7, 5)


def test_an_interlaced_png_is_counted_pass_by_pass():
    w, h = 7, 5
    passes = ((0, 0, 8, 8), (4, 0, 8, 8), (0, 4, 4, 8), (2, 0, 4, 4), (0, 2, 2, 4), (1, 0, 2, 2), (0, 1, 1, 2))
    rows = b""
    for x0, y0, dx, dy in passes:
        cols, nrows = -(-(w - x0) // dx), -(-(h - y0) // dy)
        if cols > 0 and nrows > 0:
            rows += (b"\0" + b"\x40" * (3 * cols)) * nrows
    img = load_image(_png(w, h, rows, interlace=1))
    assert img.size == (w, h) and img.getpixel((3, 3)) == (64, 64, 64)
    with pytest.raises(MediaError, match="truncated PNG"):
        load_image(_png(w, h, rows[:-10], interlace=1))


def test_pixels_are_bounded_from_the_header_before_decoding():
    buf = io.BytesIO()
    make_image(4, (300, 200)).save(buf, format="PNG")
    with pytest.raises(MediaError, match=r"300x200 = 60000 pixels, more than the limit of 1000"):
        load_image(buf.getvalue(), max_pixels=1000)
