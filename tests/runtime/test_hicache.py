"""The hierarchical cache on the real scheduler, model runner and radix tree (tiny random Llama, small pools so that
eviction happens at once): a prefix evicted to the host tier or written to the disk tier comes back before its
request's prefill, and greedy outputs equal outputs computed from scratch (float32; a host tier in the pool's own
format is a bit copy, checked on bf16 and 8-bit pools; the compact 8-bit host tier gives exactly the 8-bit format's
values); a new scheduler over the same directory (a restart) and a second one sharing it (a replica) find the pages;
corrupt, truncated, foreign and deleted files are misses; an unwritable directory or a full disk turns the disk tier
off while serving goes on; the KV invariant holds in every tier after every run."""

from __future__ import annotations

import random
import resource
import signal
import threading
import time

import pytest
import torch
from kv_helpers import check_tiers
from test_scheduler import make_scheduler, outputs, run

from radixgen.common.sampling_params import SamplingParams
from radixgen.kernels.kv_quant import dequantize_kv_ref, quantize_kv_ref
from radixgen.runtime.executor.step_messages import KVCopyQueue
from radixgen.runtime.ground.kv_pool import HostKVPool, KVPool, new_req_to_slot_table
from radixgen.runtime.scheduler.kv_manager import KVCacheManager
from radixgen.runtime.scheduler.radix import Tier
from radixgen.runtime.scheduler.request import AbortRequest, GenerateRequest, Req, ReqOutput
from radixgen.runtime.scheduler.tiers import HierarchicalCache

POOL = 160  # tokens: the workload's working set (about 300) is larger; two requests at a time fit
SYSTEM = 32


def turns(seed: int = 0, sessions: int = 6, rounds: int = 3) -> list[list[GenerateRequest]]:
    """Multi-turn sessions over one system prompt (the same for every seed): round r of every session extends
    round r-1's prompt."""
    head = torch.randint(3, 49152, (SYSTEM,), generator=torch.Generator().manual_seed(0)).tolist()
    g = torch.Generator().manual_seed(seed + 1)
    prompts = [head + torch.randint(3, 49152, (4 + 2 * s,), generator=g).tolist() for s in range(sessions)]
    out = []
    for r in range(rounds):
        batch = []
        for s in range(sessions):
            prompts[s] = prompts[s] + torch.randint(3, 49152, (8,), generator=g).tolist()
            params = SamplingParams(max_new_tokens=2, temperature=0.0, ignore_eos=True)
            batch.append(GenerateRequest(f"x{seed}-s{s}-r{r}", list(prompts[s]), params))
        out.append(batch)
    return out


def run_rounds(sched, rounds) -> dict:
    res = {}
    for batch in rounds:
        res.update(run(sched, batch))  # asserts the idle invariant (every tier's counts)
        check_tiers(sched.kv)  # and node by node: each slot and host row held once, or free
    return res


@pytest.fixture(scope="module")
def scratch(model_dir, tokenizer):
    """Every request computed from scratch (no prefix cache), page size 1 and 8."""
    return {p: outputs(run_rounds(new_sched(model_dir, tokenizer, disable_radix_cache=True, page_size=p), turns()))
            for p in (1, 8)}


def new_sched(model_dir, tokenizer, **kw):
    kw.setdefault("max_running_requests", 2)
    return make_scheduler(model_dir, tokenizer, **kw)


def tiers(sched) -> dict:
    return sched.server_info()["hicache"]


def test_host_tier_hits_equal_outputs_from_scratch(model_dir, tokenizer, scratch):
    sched = new_sched(model_dir, tokenizer, max_total_tokens=POOL, enable_hierarchical_cache=True,
                           hicache_kv_format="model")
    res = run_rounds(sched, turns() + turns())  # the second pass finds its prefixes on the host
    assert outputs(res) == scratch[1]
    info = tiers(sched)
    assert info["demoted_tokens"] > POOL and info["host_hit_tokens"] > POOL and info["disk"] is None
    assert info["host"]["format"] == "float32" and sched.kv.tree.lower_size(Tier.HOST) > 0
    details = [sched_out for sched_out in res.values()]
    assert sum(o["cached"] for o in details) > 0
    # the same pool without the tier: LRU forgets, so fewer cached tokens
    plain = new_sched(model_dir, tokenizer, max_total_tokens=POOL)
    plain_res = run_rounds(plain, turns() + turns())
    assert outputs(plain_res) == scratch[1]
    assert sum(o["cached"] for o in res.values()) > sum(o["cached"] for o in plain_res.values())


def test_compact_host_tier_and_8bit_pool(model_dir, tokenizer, scratch):
    # the CPU default: an 8-bit host tier under a float32 pool (not bit-exact: the run completes, no leak)
    sched = new_sched(model_dir, tokenizer, max_total_tokens=POOL, enable_hierarchical_cache=True)
    run_rounds(sched, turns() + turns())
    info = tiers(sched)
    assert info["host"]["format"] == "int8" and info["host_hit_tokens"] > 0
    assert info["host"]["capacity_tokens"] == 2 * POOL
    # an 8-bit pool: the host tier keeps its codes, so a tier hit gives the 8-bit mode's own outputs
    ref = outputs(run_rounds(new_sched(model_dir, tokenizer, kv_cache_dtype="int8", disable_radix_cache=True),
                             turns()))
    sched = new_sched(model_dir, tokenizer, max_total_tokens=POOL, kv_cache_dtype="int8",
                           enable_hierarchical_cache=True)
    assert outputs(run_rounds(sched, turns() + turns())) == ref and tiers(sched)["host_hit_tokens"] > 0


def manager(pool: KVPool, host_code=None) -> tuple[KVCacheManager, HierarchicalCache]:
    kv = KVCacheManager(pool.num_slots, new_req_to_slot_table(4, 64))
    host = HostKVPool(len(pool.k_buffers), 64, pool.k_buffers[0].shape[1], pool.k_buffers[0].shape[2], pool.dtype,
                      host_code or pool.code_dtype)
    copies = KVCopyQueue()
    hc = HierarchicalCache(kv, pool, host, copies, lambda: copies.take().apply(pool, host))
    kv.attach_lower_tier(hc)
    kv.hicache = hc
    return kv, hc


def request(tokens: list[int]) -> Req:
    return Req(GenerateRequest(f"r{random.random()}", tokens + [0], SamplingParams(max_new_tokens=1)), 0)


@pytest.mark.parametrize("fmt", ["bfloat16", "int8-pool", "int8-host"])
def test_a_round_trip_through_the_host_tier_is_exact(fmt):
    code = torch.int8 if fmt == "int8-pool" else None
    pool = KVPool(2, 40, 2, 8, torch.bfloat16, code_dtype=code)
    for b in pool.buffers():
        b.copy_((torch.randn(b.shape) * 3).to(b.dtype) if code is None or b.dtype != code
                else torch.randint(-127, 128, b.shape, dtype=torch.int8))
    kv, hc = manager(pool, torch.int8 if fmt == "int8-host" else None)
    tokens = list(range(100, 120))
    r = request(tokens)
    assert kv.admit(r)
    kv.extend(r, len(tokens))
    slots = kv.table.read(r.table_row, 0, len(tokens))
    before = pool.read_rows(slots)
    kv.release(r)
    kv.free(kv.tree.evict(kv.tree.evictable_size()))  # all of it to the host tier
    assert kv.tree.lower_size(Tier.HOST) == 20 and kv.usage()["free"] == kv.capacity and kv.invariant_holds()
    for b in pool.buffers():
        b.zero_()  # the pool forgets: only the host tier has the KV now
    r = request(tokens)
    load = hc.plan(r)
    assert load is not None and load.host_len == 20
    hc.load_back(r, load)
    m = kv.match(tokens)
    assert len(m.slots) == 20 and kv.tree.lower_size(Tier.HOST) == 0 and r.tier_loaded == (0, 20, 0)
    after = pool.read_rows(m.slots)
    if fmt == "int8-host":  # exactly the 8-bit format's values: quantize once, dequantize to the pool dtype
        for got, want in zip(after, before, strict=True):
            codes, scales = quantize_kv_ref(want, torch.int8)
            assert torch.equal(got, dequantize_kv_ref(codes, scales, torch.bfloat16))
    else:
        assert all(torch.equal(a.view(torch.uint8), b.view(torch.uint8)) for a, b in zip(after, before, strict=True))
    assert hc.prefetched == 20 and not kv.invariant_holds()  # loaded for a request that is not admitted yet
    kv.release(r)  # it ends before its admission
    assert hc.prefetched == 0 and kv.invariant_holds() and hc.rows.available() == hc.rows.capacity


def disk_sched(model_dir, tokenizer, path, **kw):
    kw.setdefault("max_total_tokens", POOL)
    return new_sched(model_dir, tokenizer, kv_cache_dir=str(path), page_size=8, hicache_kv_format="model", **kw)


def test_restart_and_a_replica_find_the_disk_tier(model_dir, tokenizer, scratch, tmp_path):
    first = disk_sched(model_dir, tokenizer, tmp_path, hicache_write_policy="write_through")
    assert outputs(run_rounds(first, turns())) == scratch[8]
    first.kv.hicache.disk.drain()
    written = tiers(first)["disk"]["pages_written"]
    assert written > 0
    # a restart: a new scheduler over the same folder reads the pages back; outputs unchanged
    second = disk_sched(model_dir, tokenizer, tmp_path)
    res = run_rounds(second, turns())
    assert outputs(res) == scratch[8]
    info = tiers(second)
    assert info["disk_hit_tokens"] > 0 and info["disk"]["pages_read"] > 0 and info["disk"]["read_failures"] == 0
    assert res["x0-s0-r0"]["cached"] >= SYSTEM  # the system prompt and more, from disk, on the very first request
    # a replica sharing the folder, running beside `second`: other sessions on the same system prompt
    replica = disk_sched(model_dir, tokenizer, tmp_path, hicache_write_policy="write_through")
    other = [batch[:3] for batch in turns(seed=1)]
    res = run_rounds(replica, other)
    assert tiers(replica)["disk_hit_tokens"] >= SYSTEM  # the first server's pages of the system prompt
    replica.kv.hicache.disk.drain()
    res2 = run_rounds(second, other)  # `second` finds the replica's pages of these sessions
    assert outputs(res2) == outputs(res)
    assert tiers(second)["disk_hit_tokens"] > info["disk_hit_tokens"]


def test_write_back_writes_what_leaves_the_host_tier(model_dir, tokenizer, scratch, tmp_path):
    sched = disk_sched(model_dir, tokenizer, tmp_path, hicache_ratio=0.2)  # a host tier smaller than the pool
    assert outputs(run_rounds(sched, turns())) == scratch[8]
    info = tiers(sched)
    assert info["host_evicted_tokens"] > 0
    sched.kv.hicache.disk.drain()
    assert tiers(sched)["disk"]["pages_written"] > 0
    again = disk_sched(model_dir, tokenizer, tmp_path, hicache_ratio=0.2)
    assert outputs(run_rounds(again, turns())) == scratch[8] and tiers(again)["disk_hit_tokens"] > 0


def test_bad_and_missing_pages_are_misses(model_dir, tokenizer, scratch, tmp_path):
    sched = disk_sched(model_dir, tokenizer, tmp_path, hicache_write_policy="write_through")
    run_rounds(sched, turns())
    sched.kv.hicache.disk.drain()
    files = sorted(p for p in tmp_path.rglob("*.kvp"))
    assert len(files) > 12
    data = files[1].read_bytes()
    files[0].write_bytes(data)  # another page's file under this name (its header says so)
    files[2].write_bytes(data[: len(data) // 2])  # truncated
    raw = bytearray(files[3].read_bytes())
    raw[len(raw) // 2] ^= 0xFF  # one flipped byte: the checksum
    files[3].write_bytes(bytes(raw))
    for f in files[4::3]:
        f.unlink()  # deleted under the store (it still lists them)
    res = run_rounds(sched, turns())  # the same scheduler: its host tier and the disk tier, now with holes
    assert outputs(res) == scratch[8]
    fresh = disk_sched(model_dir, tokenizer, tmp_path)
    assert outputs(run_rounds(fresh, turns())) == scratch[8]
    assert tiers(fresh)["disk"]["read_failures"] + tiers(sched)["disk"]["read_failures"] > 0


def test_an_unwritable_folder_or_a_full_disk_turns_the_disk_tier_off(model_dir, tokenizer, scratch, tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    sched = disk_sched(model_dir, tokenizer, blocker / "kv")
    assert outputs(run_rounds(sched, turns())) == scratch[8]
    info = tiers(sched)["disk"]
    assert not info["enabled"] and "cannot use" in info["disabled_reason"]
    # a full disk: writes fail with EFBIG beyond 1 KiB (a page is larger), the tier turns off, serving goes on
    sched = disk_sched(model_dir, tokenizer, tmp_path / "full", hicache_write_policy="write_through")
    old_handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    old_limit = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (1024, old_limit[1]))
    try:
        res = run_rounds(sched, turns())
        sched.kv.hicache.disk.drain()
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, old_limit)
        signal.signal(signal.SIGXFSZ, old_handler)
    assert outputs(res) == scratch[8]
    info = tiers(sched)["disk"]
    assert not info["enabled"] and info["write_failures"] >= 1 and "File too large" in info["disabled_reason"]
    assert not list((tmp_path / "full").rglob("*.kvp")) and not list((tmp_path / "full").rglob("*.tmp"))


def test_an_abort_during_a_disk_read_leaks_nothing(model_dir, tokenizer, tmp_path):
    sched = disk_sched(model_dir, tokenizer, tmp_path, hicache_write_policy="write_through")
    rounds = turns()
    run(sched, rounds[0])
    sched.kv.hicache.disk.drain()
    fresh = disk_sched(model_dir, tokenizer, tmp_path)
    req = rounds[0][0]
    fresh.handle_message(req)
    fresh.step()  # planned: its pages are being read
    assert len(fresh.waits) == 1 or fresh.kv.hicache.counts["loads"] == 1
    fresh.handle_message(AbortRequest(req.rid))
    for _ in range(100):
        fresh.step()
        fresh.outbox.clear()
        if fresh.is_idle():
            break
        time.sleep(0.002)
    assert fresh.is_idle() and fresh.invariant_holds()
    assert fresh.kv.hicache.staged == 0


def test_what_the_hierarchical_cache_refuses():
    from radixgen.runtime.config import RuntimeConfig

    cases = {"page_size=1": (dict(kv_cache_dir="/tmp/x"), "page_size=1 is too small"),
             "tensor parallel": (dict(enable_hierarchical_cache=True, tp_size=2), "not supported with tensor"),
             "no radix cache": (dict(enable_hierarchical_cache=True, disable_radix_cache=True), "needs the radix"),
             "format": (dict(enable_hierarchical_cache=True, kv_cache_dtype="int8", hicache_kv_format="fp8_e4m3"),
                        "keeps the pool's own codes"),
             "policy": (dict(enable_hierarchical_cache=True, hicache_write_policy="write_through_selective"),
                        "hicache_write_policy must be one of"),
             "ratio": (dict(enable_hierarchical_cache=True, hicache_ratio=0.0), "must be > 0"),
             "draft model": (dict(enable_hierarchical_cache=True, speculative_draft_model="/x"), "draft model's KV")}
    for kw, msg in cases.values():
        with pytest.raises(ValueError, match=msg):
            RuntimeConfig(**kw)
    cfg = RuntimeConfig(kv_cache_dir="/tmp/x", page_size=16)
    assert cfg.hicache_enabled and cfg.hicache_code_dtype == torch.int8  # the CPU's compact default
    assert RuntimeConfig(enable_hierarchical_cache=True, hicache_kv_format="model").hicache_code_dtype is None
    assert RuntimeConfig(device="cuda", enable_hierarchical_cache=True).hicache_code_dtype is None


def gated(store, method: str) -> threading.Event:
    """Make `store.method` wait (on the store's own threads) until the returned event is set."""
    gate, real = threading.Event(), getattr(store, method)

    def wait_then(*a, **kw):
        assert gate.wait(60), "the gate was never opened"
        return real(*a, **kw)

    setattr(store, method, wait_then)
    return gate


def step_until(sched, done, steps: int = 400) -> dict:
    out = {}
    for _ in range(steps):
        sched.step()
        for msg in sched.outbox:
            if isinstance(msg, ReqOutput):
                o = out.setdefault(msg.rid, {"ids": [], "finish": None})
                o["ids"] += msg.new_ids
                o["finish"] = msg.finish_reason
        sched.outbox.clear()
        if done(out):
            return out
        time.sleep(0.002)
    raise AssertionError(f"not done after {steps} steps: {out}")


def test_a_disk_load_in_flight_holds_up_only_its_request(model_dir, tokenizer, scratch, tmp_path):
    """While a request's pages are read (held up here), another request is admitted, decodes and finishes with
    its outputs unchanged; then the first one gets its pages and its outputs; an abort during a read leaks
    nothing once the read ends."""
    first = disk_sched(model_dir, tokenizer, tmp_path, hicache_write_policy="write_through")
    rounds = turns()
    run(first, rounds[0])
    first.kv.hicache.disk.drain()
    fresh = disk_sched(model_dir, tokenizer, tmp_path)
    gate = gated(fresh.kv.hicache.disk, "read_page")
    waiting, other = rounds[0][0], rounds[0][1]
    alone = GenerateRequest("other", [7] + other.input_ids[1:], other.params)  # nothing of it on disk
    expect = outputs(run(new_sched(model_dir, tokenizer, page_size=8, disable_radix_cache=True), [alone]))
    fresh.handle_message(waiting)
    fresh.step()  # planned: its reads are blocked
    fresh.handle_message(alone)
    out = step_until(fresh, lambda o: o.get("other", {}).get("finish") is not None)
    assert out["other"]["ids"] == expect["other"] and waiting.rid not in out  # the other one ran meanwhile
    assert len(fresh.waits) == 1
    gate.set()
    out = step_until(fresh, lambda o: o.get(waiting.rid, {}).get("finish") is not None)
    assert out[waiting.rid]["ids"] == scratch[8][waiting.rid] and tiers(fresh)["disk_hit_tokens"] >= SYSTEM
    assert fresh.is_idle() and fresh.invariant_holds()

    aborting = disk_sched(model_dir, tokenizer, tmp_path)
    gate = gated(aborting.kv.hicache.disk, "read_page")
    aborting.handle_message(rounds[0][2])
    aborting.step()
    assert aborting.kv.hicache.staged > 0  # tier-1 rows held by the blocked read
    aborting.handle_message(AbortRequest(rounds[0][2].rid))
    out = step_until(aborting, lambda o: o.get(rounds[0][2].rid, {}).get("finish") is not None)
    assert aborting.is_idle() and aborting.kv.hicache.staged > 0  # its rows stay with the read still running
    gate.set()
    assert aborting.invariant_holds() and aborting.kv.hicache.staged == 0  # then every row is back
    assert aborting.kv.invariant_holds()


def test_pages_written_down_are_found_while_still_queued(model_dir, tokenizer, scratch, tmp_path):
    """Write-back with the writer held up: what leaves the host tier is matched again at once (the next pass)
    and read from the writer's queue: the same outputs, and nothing leaks."""
    sched = disk_sched(model_dir, tokenizer, tmp_path, hicache_ratio=0.2)
    gate = gated(sched.kv.hicache.disk, "_write")
    res = run_rounds(sched, turns() + turns())
    assert outputs(res) == scratch[8]
    info = tiers(sched)
    assert info["host_evicted_tokens"] > 0 and info["disk"]["pages_read_queued"] > 0
    assert info["disk"]["pages_written"] == 0  # nothing reached the files yet
    gate.set()
    sched.kv.hicache.disk.drain()
    assert tiers(sched)["disk"]["pages_written"] > 0 and sched.invariant_holds()


def test_holds_keep_loaded_prefixes_until_admission_and_yield_rather_than_block():
    pool = KVPool(2, 40, 2, 8, torch.float32)
    kv, hc = manager(pool)
    prefixes = [list(range(100, 116)), list(range(200, 216))]
    for tokens in prefixes:  # each computed once, then all of it to the host tier
        r = request(tokens)
        assert kv.admit(r)
        kv.extend(r, len(tokens))
        kv.release(r)
    kv.free(kv.tree.evict(kv.tree.evictable_size()))
    held = [request(tokens) for tokens in prefixes]
    for r in held:
        hc.load_back(r, hc.plan(r))
        assert r.tier_hold is not None and r.tier_prefetched == 16
    assert kv.tree.protected_size() == 32 and hc.reserved == 2  # held, and room kept for their prefills
    kv.free(kv.tree.evict(kv.capacity))  # nothing held can be evicted (by those admitted first)
    assert all(len(kv.match(t).slots) == 16 for t in prefixes)
    other = request(list(range(300, 330)))  # does not fit beside the holds, and no request runs
    assert kv.admit(other) and not kv.can_allocate(30)
    kv.unadmit(other)  # what the scheduler does then: the holds yield
    assert hc.counts["holds_yielded"] == 1 and kv.tree.protected_size() == 0 and kv.can_allocate(30)
    assert kv.admit(other)
    kv.extend(other, 30)
    for r in [*held, other]:
        kv.release(r)
    kv.free(kv.tree.evict(kv.capacity))  # all of it to the host tier again
    running = request(list(range(400, 420)))
    assert kv.admit(running)
    kv.extend(running, 20)
    again = request(prefixes[0])
    hc.load_back(again, hc.plan(again))
    assert again.tier_hold is not None and not kv.can_allocate(9)
    assert kv.can_allocate(9, running=True) and again.tier_hold is None  # a running request's need comes first
    kv.release(again)
    kv.release(running)
    assert hc.prefetched == 0 and hc.reserved == 0 and kv.invariant_holds()
