"""Image sources from network clients (common.media.ClientSource): never a file of the server's disk unless it is
under the allowed folder, decided without looking at the disk when no folder is allowed; in-process sources may
name any path."""

from __future__ import annotations

import base64
import io
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tiny_vlm import make_image, png_bytes  # noqa: E402

from radixgen.common.media import ClientSource, MediaError, client_sources, load_image  # noqa: E402


def test_a_client_path_is_read_only_under_the_allowed_folder(tmp_path):
    allowed, other = tmp_path / "images", tmp_path / "private"
    allowed.mkdir()
    other.mkdir()
    img = make_image(1, (8, 6))
    (allowed / "cat.png").write_bytes(png_bytes(img))
    (other / "secret.png").write_bytes(png_bytes(make_image(2, (8, 6))))
    inside, outside = str(allowed / "cat.png"), str(other / "secret.png")
    assert load_image(inside).size == (8, 6)  # an in-process caller's path: read wherever it is
    for src in (inside, outside, str(tmp_path / "missing.png")):  # no folder allowed: refused, existing or not
        with pytest.raises(MediaError, match=r"local file paths are not read on this server"):
            load_image(ClientSource(src))
    assert load_image(ClientSource(inside), local_root=str(allowed)).tobytes() == img.tobytes()
    assert load_image(ClientSource("file://" + inside), local_root=str(allowed)).size == (8, 6)
    for src in (outside, str(allowed / ".." / "private" / "secret.png"), "file://" + outside):
        with pytest.raises(MediaError, match=r"outside the folder this server reads images from"):
            load_image(ClientSource(src), local_root=str(allowed))
    # base64 (a JPEG's starts with "/9j/") and data URLs are read as before
    buf = io.BytesIO()
    img.save(buf, format="JPEG")
    b64 = base64.b64encode(buf.getvalue()).decode()
    assert b64.startswith("/9j/") and load_image(ClientSource(b64)).size == (8, 6)
    assert load_image(ClientSource("data:image/jpeg;base64," + b64)).size == (8, 6)
    assert client_sources([["a", None], "b"]) == [["a", None], "b"]
    assert all(isinstance(x, ClientSource) for x in client_sources(["a", "b"]))
