"""The disk tier repairs what it finds corrupt (issue 46 item 6), on the real scheduler (test_hicache.py's tiny model
and workload): the first page of every prompt's chain fails its checksum; the next server misses it, removes the
file and writes the recomputed page in its place, and the server after that hits the whole prefix again."""

from __future__ import annotations

import json
import struct

from test_hicache import SYSTEM, disk_sched, run_rounds, tiers, turns
from test_scheduler import outputs


def _header(path) -> dict:
    data = path.read_bytes()
    (n,) = struct.unpack("<I", data[8:12])
    return json.loads(data[12:12 + n])


def test_corrupt_pages_are_replaced_so_the_next_restart_hits_the_whole_prefix(model_dir, tokenizer, tmp_path):
    first = disk_sched(model_dir, tokenizer, tmp_path, hicache_write_policy="write_through")
    expected = outputs(run_rounds(first, turns()))
    first.kv.hicache.disk.drain()
    firsts = [f for f in tmp_path.rglob("*.kvp") if _header(f)["parent"] == ""]
    assert len(firsts) == 1  # the system prompt's first page: every request's prefix starts with it
    raw = bytearray(firsts[0].read_bytes())
    raw[len(raw) // 2] ^= 0xFF  # it fails its checksum
    firsts[0].write_bytes(bytes(raw))
    second = disk_sched(model_dir, tokenizer, tmp_path, hicache_write_policy="write_through")
    assert outputs(run_rounds(second, turns())) == expected
    second.kv.hicache.disk.drain()
    assert tiers(second)["disk"]["read_failures"] > 0
    third = disk_sched(model_dir, tokenizer, tmp_path)
    res = run_rounds(third, turns())
    assert outputs(res) == expected and tiers(third)["disk"]["read_failures"] == 0
    assert res["x0-s0-r0"]["cached"] >= SYSTEM  # the system prompt from disk again, on the very first request
