"""Tier 2 of the hierarchical cache: a directory of page files, kept across restarts and shared by servers.

A page is `page_size` tokens of one rank's KV, every layer, in the host tier's format. Its file is named by a hash
of its token chain: the store's fingerprint (model, weights, quantization, KV format, page size, dtype, rank), the
radix namespace (cache salt, API-key scope), and every token from the start of the sequence to the page's end
(`page_names`), so a page is only ever found by a request whose whole prefix is the same, on a server that would
have computed the same KV. Files live under `<dir>/<fingerprint[:16]>/<name[:2]>/<name>.kvp`:

    MAGIC (8 bytes) | header length (u32 LE) | header (JSON: fingerprint, name, parent name, tokens, tensor shapes
    and dtypes) | payload (each tensor's bytes, in the header's order) | CRC32 of everything before (u32 LE)

Writes happen on a writer thread, off the step: the bytes go to a hidden temporary file in the same folder, are
fsync'ed, then `os.replace` puts it under its name (atomic on POSIX: a reader sees the whole file or none; a
server killed in the middle leaves only a temporary file, which the next store removes; after a power loss a page
is whole or absent, or at worst, the folder's rename not being synced, missing: a miss). The folder itself is not
fsync'ed per page: that would double the writes' cost for what is only ever a miss. Reads check the magic, the CRC, the
fingerprint, the name, the parent and the tokens: a corrupt, truncated or foreign file is a miss (logged), never
KV, and is removed (unless a writer replaced it meanwhile), so that the recomputed page is written in its place and
the next start hits the whole prefix again (the pages after a bad one in a read are checked too). A write that fails
for lack of space or permission (ENOSPC, EROFS, EACCES, EDQUOT, EFBIG) turns the tier off with a warning; serving
goes on with tiers 0 and 1. Pages over `max_bytes` go least recently used first (the file's mtime, refreshed on
every read, so replicas sharing the folder and the next start see one order).
"""

from __future__ import annotations

import errno
import hashlib
import json
import logging
import os
import queue
import socket
import struct
import threading
import time
import zlib
from array import array
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

MAGIC = b"RGKVPG01"
SUFFIX = ".kvp"
# errors that say the folder takes no more pages: the tier turns off
UNWRITABLE = {errno.ENOSPC, errno.EROFS, errno.EACCES, errno.EPERM, errno.EDQUOT, errno.EFBIG, errno.ENOTDIR}
STALE_TMP_S = 600.0  # a temporary file this old is a dead writer's, whatever host wrote it
_DTYPES = {str(d): d for d in (torch.float32, torch.bfloat16, torch.float16, torch.int8, torch.float8_e4m3fn,
                              torch.uint8)}


def page_names(fingerprint: str, namespace: str | None, tokens, page_size: int, upto: int | None = None) -> list[str]:
    """The file names of the first `upto` whole pages of `tokens` (all of them by default): name i hashes name i-1
    (the chain so far) and page i's tokens; the first hashes the fingerprint and the namespace."""
    n = len(tokens) // page_size if upto is None else min(upto, len(tokens) // page_size)
    prev = hashlib.sha256(f"{fingerprint}\x00{namespace!r}".encode()).digest()
    out = []
    for i in range(n):
        page = array("q", tokens[i * page_size:(i + 1) * page_size]).tobytes()  # int64, native order
        prev = hashlib.sha256(prev + page).digest()
        out.append(prev[:16].hex())
    return out


class Page:
    """One page to write: its name, its parent's name ('' for the first page), its tokens and tensors."""

    __slots__ = ("name", "parent", "tokens", "rows")

    def __init__(self, name: str, parent: str, tokens: list[int], rows: list[torch.Tensor]) -> None:
        self.name, self.parent, self.tokens, self.rows = name, parent, tokens, rows


class DiskStore:
    def __init__(self, root: str | os.PathLike, fingerprint: str, max_bytes: int, queue_pages: int = 1024) -> None:
        self.fingerprint = fingerprint
        self.max_bytes = max_bytes
        self.dir = Path(root) / fingerprint[:16]
        self.enabled, self.reason = True, None  # reason: why the tier is off
        self.counts = dict(pages_written=0, pages_read=0, pages_read_queued=0, read_misses=0, read_failures=0,
                           write_failures=0, writes_dropped=0, pages_evicted=0, tmp_removed=0)
        self._index: dict[str, tuple[int, float]] = {}  # name -> (bytes, last use) of the pages this store knows
        self._pending: dict[str, Page] = {}  # queued for the writer (read from memory until written)
        self._bytes = 0
        self._lock = threading.Lock()  # _index, _bytes, counts: the writer thread and the scheduler's
        self._tag = f".{socket.gethostname()}.{os.getpid()}."
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
            self._scan()
        except OSError as e:
            self._turn_off(f"cannot use {self.dir}: {e}")
        self._queue: queue.Queue = queue.Queue(maxsize=queue_pages)
        self._writer = threading.Thread(target=self._write_loop, name="kv-disk-writer", daemon=True)
        self._writer.start()
        self._readers = ThreadPoolExecutor(2, thread_name_prefix="kv-disk-reader")

    # ------------------------------------------------------------------ queries

    def path(self, name: str) -> Path:
        return self.dir / name[:2] / f"{name}{SUFFIX}"

    def has(self, name: str) -> bool:
        """Whether the page is there now: queued for the writer, or its file (another replica may have written it;
        one may remove it later)."""
        if not self.enabled:
            return False
        with self._lock:
            if name in self._pending:
                return True
        return self.path(name).is_file()

    def known(self, name: str) -> bool:
        """Written, seen or queued by this store (no file system call)."""
        with self._lock:
            return name in self._index or name in self._pending

    def size_bytes(self) -> int:
        return self._bytes

    def info(self) -> dict:
        with self._lock:
            return {"enabled": self.enabled, "dir": str(self.dir), "disabled_reason": self.reason,
                    "pages": len(self._index), "bytes": self._bytes, "max_bytes": self.max_bytes,
                    "write_queue": self._queue.qsize(), **self.counts}

    # ------------------------------------------------------------------ writes (the writer thread)

    def write(self, page: Page) -> None:
        """Queue a page for the writer thread; dropped (counted) when the queue is full: the step never waits."""
        if not self.enabled or self.known(page.name):
            return
        with self._lock:
            self._pending[page.name] = page
        try:
            self._queue.put_nowait(page)
        except queue.Full:
            with self._lock:
                self._pending.pop(page.name, None)
                self.counts["writes_dropped"] += 1

    def drain(self, timeout: float = 30.0) -> None:
        """Wait until every queued page is written (tests, shutdown)."""
        deadline = time.monotonic() + timeout
        while self._queue.unfinished_tasks and time.monotonic() < deadline:
            time.sleep(0.005)

    def _write_loop(self) -> None:
        while True:
            page = self._queue.get()
            try:
                if page is None:
                    return
                if self.enabled:
                    self._write(page)
            except Exception:  # noqa: BLE001 - a bug in one write must not stop the thread
                logger.exception("writing KV page %s failed", page.name)
            finally:
                if page is not None:
                    with self._lock:
                        self._pending.pop(page.name, None)
                self._queue.task_done()

    def _write(self, page: Page) -> None:
        path = self.path(page.name)
        if path.is_file():  # another replica wrote it: the same tokens under the same fingerprint, the same KV
            self._remember(page.name, path.stat().st_size)
            return
        data = encode(self.fingerprint, page)
        tmp = path.with_name(f".{page.name}{self._tag}{threading.get_ident()}.tmp")
        try:
            path.parent.mkdir(exist_ok=True)
            with open(tmp, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())  # the bytes are on disk before the name is: a power loss keeps whole pages
            os.replace(tmp, path)  # atomic: readers see all of it or nothing; two writers: the last rename wins
        except OSError as e:
            _unlink(tmp)
            with self._lock:
                self.counts["write_failures"] += 1
            if e.errno in UNWRITABLE:
                self._turn_off(f"writing {path} failed: {e}")
            else:
                logger.warning("KV disk tier: writing %s failed: %s", path, e)
            return
        with self._lock:
            self.counts["pages_written"] += 1
        self._remember(page.name, len(data))
        self._shrink()

    def _remember(self, name: str, nbytes: int) -> None:
        with self._lock:
            old = self._index.get(name)
            self._bytes += nbytes - (old[0] if old else 0)
            self._index[name] = (nbytes, time.time())

    def _shrink(self) -> None:
        """Remove least recently used pages until the known ones fit in max_bytes."""
        with self._lock:
            if self._bytes <= self.max_bytes:
                return
            order = sorted(self._index.items(), key=lambda kv: kv[1][1])
            victims = []
            for name, (nbytes, _) in order:
                if self._bytes <= self.max_bytes * 0.9:
                    break
                victims.append(name)
                self._bytes -= nbytes
                del self._index[name]
            self.counts["pages_evicted"] += len(victims)
        for name in victims:
            _unlink(self.path(name))

    def _turn_off(self, why: str) -> None:
        if self.enabled:
            logger.warning("KV disk tier off: %s; serving goes on without it", why)
        self.enabled, self.reason = False, why

    # ------------------------------------------------------------------ reads (reader threads)

    def read(self, names: list[str], parents: list[str], tokens: list[list[int]], sink) -> Future:
        """Read pages on a reader thread; `sink(i, rows)` takes page i's tensors as it arrives. The future's result:
        how many leading pages were read (a missing or bad page ends the run: the rest would not be contiguous)."""
        return self._readers.submit(self._read_run, names, parents, tokens, sink)

    def _read_run(self, names, parents, tokens, sink) -> int:
        for i, (name, parent, toks) in enumerate(zip(names, parents, tokens, strict=True)):
            rows = self.read_page(name, parent, toks)
            if rows is None:
                for later in zip(names[i + 1:], parents[i + 1:], tokens[i + 1:], strict=True):
                    self.read_page(*later, verify_only=True)  # bad ones go now, to be written again
                return i
            sink(i, rows)
        return len(names)

    def read_page(self, name: str, parent: str, tokens: list[int],
                  verify_only: bool = False) -> list[torch.Tensor] | None:
        """One page's tensors, or None: missing (a miss), or unreadable / corrupt / foreign (a miss, logged, its
        file removed). A page still queued for the writer is read from its queued copy (a prefix written down and
        matched again at once is a hit, not a race). `verify_only`: only check the file (a page behind a bad
        one, which the request recomputes anyway): nothing is counted as read and no tensors are returned."""
        with self._lock:
            queued = self._pending.get(name)
        if queued is not None and queued.parent == parent and list(queued.tokens) == list(tokens):
            if verify_only:  # nothing on disk to check yet
                return None
            with self._lock:
                self.counts["pages_read_queued"] += 1
            return [t.clone() for t in queued.rows]
        path = self.path(name)
        try:
            before = _identity(path)
            data = path.read_bytes()
        except FileNotFoundError:
            with self._lock:
                self.counts["read_misses"] += 0 if verify_only else 1
                self._forget(name)
            return None
        except OSError as e:
            return self._bad(path, f"cannot be read: {e}")
        try:
            rows = decode(data, self.fingerprint, name, parent, tokens)
        except ValueError as e:
            if _identity(path) == before:  # the bad file itself, not a whole one a writer renamed over it since
                _unlink(path)
            return self._bad(path, f"{e} (removed: the page is written again when it is computed)")
        if verify_only:  # a good file, not read for use: its LRU time and the read counts stay
            return None
        try:
            os.utime(path)  # its last use, for every replica's LRU
        except OSError:
            pass
        with self._lock:
            self.counts["pages_read"] += 1
        self._remember(name, len(data))
        return rows

    def _bad(self, path: Path, why: str) -> None:
        logger.warning("KV disk tier: %s %s; treated as a miss", path, why)
        with self._lock:
            self.counts["read_failures"] += 1
            self._forget(path.name.removesuffix(SUFFIX))
        return None

    def _forget(self, name: str) -> None:
        old = self._index.pop(name, None)
        if old is not None:
            self._bytes -= old[0]

    # ------------------------------------------------------------------ start-up and shutdown

    def _scan(self) -> None:
        """Index the folder's pages (by mtime: their last use) and remove dead writers' temporary files."""
        now = time.time()
        for sub in self.dir.iterdir():
            if not sub.is_dir():
                continue
            for entry in os.scandir(sub):
                if entry.name.endswith(".tmp"):
                    if self._stale_tmp(entry, now):
                        _unlink(Path(entry.path))
                        self.counts["tmp_removed"] += 1
                elif entry.name.endswith(SUFFIX):
                    st = entry.stat()
                    self._index[entry.name.removesuffix(SUFFIX)] = (st.st_size, st.st_mtime)
                    self._bytes += st.st_size
        self._shrink()

    def _stale_tmp(self, entry: os.DirEntry, now: float) -> bool:
        """A temporary file whose writer is gone: this host's and its process has exited, or older than STALE_TMP_S
        (another host's, or a reused pid)."""
        try:
            if now - entry.stat().st_mtime > STALE_TMP_S:
                return True
        except FileNotFoundError:
            return False
        parts = entry.name.split(".")  # "", name, kvp-host parts..., pid, thread, "tmp"
        host, pid = ".".join(parts[2:-3]), parts[-3]
        if host != socket.gethostname() or not pid.isdigit():
            return False
        try:
            os.kill(int(pid), 0)
        except ProcessLookupError:
            return True
        except OSError:
            return False
        return False  # its writer is alive (this process's own writer included)

    def close(self) -> None:
        self._queue.put(None)
        self._writer.join(timeout=30)
        self._readers.shutdown(wait=True)


def encode(fingerprint: str, page: Page) -> bytes:
    tensors = [t.contiguous() for t in page.rows]
    header = json.dumps({"fingerprint": fingerprint, "name": page.name, "parent": page.parent,
                         "tokens": list(page.tokens),
                         "tensors": [[list(t.shape), str(t.dtype)] for t in tensors]}).encode()
    body = b"".join([MAGIC, struct.pack("<I", len(header)), header,
                     *(_raw(t).numpy().tobytes() for t in tensors)])
    return body + struct.pack("<I", zlib.crc32(body))


def decode(data: bytes, fingerprint: str, name: str, parent: str, tokens: list[int]) -> list[torch.Tensor]:
    """The page's tensors; ValueError naming what is wrong with the file."""
    if len(data) < len(MAGIC) + 8 or data[:len(MAGIC)] != MAGIC:
        raise ValueError("is not a KV page file (bad magic or truncated)")
    (crc,) = struct.unpack("<I", data[-4:])
    if zlib.crc32(data[:-4]) != crc:
        raise ValueError("fails its checksum (corrupt or truncated)")
    (hlen,) = struct.unpack("<I", data[len(MAGIC):len(MAGIC) + 4])
    start = len(MAGIC) + 4
    try:
        header = json.loads(data[start:start + hlen])
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"has an unreadable header: {e}") from None
    if header.get("fingerprint") != fingerprint:
        raise ValueError("belongs to another model or KV layout (fingerprint differs)")
    if header.get("name") != name or header.get("parent") != parent or header.get("tokens") != list(tokens):
        raise ValueError("holds another token chain than its name says")
    out, pos = [], start + hlen
    buf = bytearray(data)  # one writable copy; each tensor is a view into it
    for shape, dtype in header["tensors"]:
        dt = _DTYPES.get(dtype)
        if dt is None:
            raise ValueError(f"has an unknown dtype {dtype}")
        n = torch.Size(shape).numel() * torch.empty((), dtype=dt).element_size()
        if pos + n > len(data) - 4:
            raise ValueError("is truncated")
        raw = torch.frombuffer(buf, dtype=torch.uint8, count=n, offset=pos) if n else torch.zeros(0, torch.uint8)
        out.append(raw.view(dt).reshape(shape))
        pos += n
    if pos != len(data) - 4:
        raise ValueError("has trailing bytes")
    return out


def _raw(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes as uint8 (numpy has no bfloat16 / float8)."""
    return t.cpu().reshape(-1).view(torch.uint8)


def _identity(path: Path) -> tuple[int, int, int] | None:
    """What tells one file at `path` from another later renamed over it (None: nothing there)."""
    try:
        return (st := path.stat()).st_ino, st.st_size, st.st_mtime_ns
    except OSError:
        return None


def _unlink(path: Path) -> None:
    try:
        path.unlink()
    except OSError:
        pass
