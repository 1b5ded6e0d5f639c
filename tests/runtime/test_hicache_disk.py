"""The disk tier's page store on its own (no model): the file format's checks, pages named by their token chain and
namespace, two stores writing the same pages at once, the least-recently-used size limit, and a writer process
killed with SIGKILL in the middle of its writes (its temporary files are removed by the next store, and every page
file left is whole)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import pytest
import torch

from radixgen.runtime.scheduler.tiers.disk import DiskStore, Page, decode, encode, page_names

FP = "f" * 64


def page(i: int, size: int = 64, parent: str = "") -> Page:
    g = torch.Generator().manual_seed(i)
    rows = [torch.randn(size, 2, 4, generator=g).to(torch.bfloat16), torch.randint(-127, 128, (size, 2), generator=g,
                                                                                   dtype=torch.int8)]
    return Page(f"{i:032x}", parent, list(range(i, i + 4)), rows)


def test_names_follow_the_whole_chain_and_the_namespace():
    a = page_names(FP, None, [1, 2, 3, 4, 5, 6, 7, 8, 9], 4)
    assert len(a) == 2 and len(set(a)) == 2
    assert page_names(FP, None, [1, 2, 3, 4, 5, 6, 7, 9], 4)[:1] == a[:1]  # the same first page
    assert page_names(FP, None, [1, 2, 3, 4, 5, 6, 7, 9], 4)[1] != a[1]
    assert page_names(FP, None, [0, 2, 3, 4, 5, 6, 7, 8], 4)[1] != a[1]  # the chain: an earlier token differs
    assert page_names(FP, "salt", [1, 2, 3, 4, 5, 6, 7, 8], 4) != a  # another namespace
    assert page_names("e" * 64, None, [1, 2, 3, 4, 5, 6, 7, 8], 4) != a  # another model / layout
    assert page_names(FP, None, list(range(1, 9)), 4, upto=1) == a[:1]


def test_a_page_file_is_checked_before_use():
    p = page(1, parent="ab" * 16)
    data = encode(FP, p)
    rows = decode(data, FP, p.name, p.parent, p.tokens)
    assert all(torch.equal(a.view(torch.uint8), b.view(torch.uint8)) for a, b in zip(rows, p.rows, strict=True))
    assert [r.dtype for r in rows] == [torch.bfloat16, torch.int8]
    bad = {"bad magic": b"X" + data[1:], "checksum": data[:100] + bytes([data[100] ^ 1]) + data[101:],
           "truncated": data[:-10], "empty": b""}
    for blob in bad.values():
        with pytest.raises(ValueError):
            decode(blob, FP, p.name, p.parent, p.tokens)
    with pytest.raises(ValueError, match="fingerprint"):
        decode(data, "e" * 64, p.name, p.parent, p.tokens)
    with pytest.raises(ValueError, match="token chain"):
        decode(data, FP, p.name, p.parent, [9, 9, 9, 9])
    with pytest.raises(ValueError, match="token chain"):
        decode(data, FP, p.name, "", p.tokens)


def test_two_stores_writing_the_same_pages_at_once(tmp_path):
    stores = [DiskStore(tmp_path, FP, 1 << 30) for _ in range(2)]
    pages = [page(i) for i in range(20)]
    threads = [threading.Thread(target=lambda s=s: [s.write(p) for p in pages]) for s in stores]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for s in stores:
        s.drain()
    files = sorted(tmp_path.rglob("*.kvp"))
    assert len(files) == 20 and not list(tmp_path.rglob("*.tmp"))
    reader = DiskStore(tmp_path, FP, 1 << 30)
    assert reader.info()["pages"] == 20
    for p in pages:
        rows = reader.read_page(p.name, p.parent, p.tokens)
        assert rows is not None and torch.equal(rows[1], p.rows[1])
    assert reader.read_page("e" * 32, "", [0, 1, 2, 3]) is None and reader.counts["read_misses"] == 1
    for s in (*stores, reader):
        s.close()


def test_pages_over_the_size_limit_go_least_recently_used_first(tmp_path):
    one = len(encode(FP, page(0)))
    store = DiskStore(tmp_path, FP, max_bytes=10 * one)
    for i in range(8):
        store.write(page(i))
    store.drain()
    time.sleep(0.01)
    assert store.read_page(page(0).name, "", page(0).tokens) is not None  # page 0 used again: kept
    for i in range(8, 14):
        store.write(page(i))
    store.drain()
    names = {f.name.removesuffix(".kvp") for f in tmp_path.rglob("*.kvp")}
    assert page(0).name in names and page(1).name not in names and page(13).name in names
    assert store.size_bytes() <= 10 * one and store.counts["pages_evicted"] >= 4
    store.close()


WRITER = textwrap.dedent("""
    import sys, torch
    from radixgen.runtime.scheduler.tiers.disk import DiskStore, Page
    store = DiskStore(sys.argv[1], "f" * 64, 1 << 34, queue_pages=4)
    big = [torch.randn(4096, 8, 64)]  # 8 MiB a page: killed in the middle of one
    print("ready", flush=True)
    for i in range(64):  # at most 512 MiB, if the kill comes late
        store.write(Page(f"{i:032x}", "", [i], big))
    store.drain()
""")


def test_sigkill_in_the_middle_of_writes_leaves_whole_pages_or_nothing(tmp_path):
    proc = subprocess.Popen([sys.executable, "-c", WRITER, str(tmp_path)], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "ready"
    while proc.poll() is None and not list(tmp_path.rglob("*.tmp")):
        time.sleep(0.0005)
    os.kill(proc.pid, signal.SIGKILL)  # with a temporary file open: mid-write
    proc.wait()
    assert list(tmp_path.rglob("*.tmp")), "the writer was never caught mid-write"
    store = DiskStore(tmp_path, FP, 1 << 34)
    assert store.counts["tmp_removed"] >= 1 and not list(tmp_path.rglob("*.tmp"))
    for f in tmp_path.rglob("*.kvp"):
        name = f.name.removesuffix(".kvp")
        assert store.read_page(name, "", [int(name, 16)]) is not None  # whole, checksum and all
    assert store.counts["read_failures"] == 0
    store.close()


def test_a_corrupt_page_is_removed_and_written_again(tmp_path):
    """Issue 46 item 6: a page failing its checksum is a miss and its file goes, so the recomputed page is written
    in its place and a restarted store reads it."""
    store = DiskStore(tmp_path, FP, max_bytes=1 << 30)
    p = page(7)
    store.write(p)
    store.drain()
    path = store.path(p.name)
    raw = bytearray(path.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    path.write_bytes(bytes(raw))
    assert store.read_page(p.name, p.parent, p.tokens) is None and store.info()["read_failures"] == 1
    assert not path.exists() and not store.known(p.name)
    store.write(p)  # the page computed again
    store.drain()
    store.close()
    again = DiskStore(tmp_path, FP, max_bytes=1 << 30)  # a restart
    rows = again.read_page(p.name, p.parent, p.tokens)
    assert rows is not None and all(torch.equal(a.view(torch.uint8), b.view(torch.uint8))
                                    for a, b in zip(rows, p.rows, strict=True))
    assert again.info()["read_failures"] == 0
    again.close()
