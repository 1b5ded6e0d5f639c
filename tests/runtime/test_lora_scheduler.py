"""Multi-LoRA serving in the scheduler, in-process on the tiny Llama: greedy outputs equal PEFT's, a radix-tree
namespace per adapter, LRU replacement with more adapters than slots (a request waits for its adapter, never
fails for it, and does not hold others up), unload while requests run, pinning, and bad adapters refused by
name with nothing leaked."""

from __future__ import annotations

import json
import time

import pytest
from lora_helpers import base_model, greedy, make_adapter
from test_scheduler import run
from tiny_models import tiny_model_dir

from radixgen.common.sampling_params import SamplingParams
from radixgen.kernels import cpu
from radixgen.runtime.config import RuntimeConfig
from radixgen.runtime.executor.model_runner import ModelRunner
from radixgen.runtime.loader import load_tokenizer
from radixgen.runtime.scheduler import Scheduler
from radixgen.runtime.scheduler.request import (
    AbortRequest,
    FinishReason,
    GenerateRequest,
    LoadLoRAAdapter,
    LoRAUpdate,
    ReqOutput,
    UnloadLoRAAdapter,
)

PROMPTS = [[5, 9, 13, 17, 21, 400, 7, 8], [11, 12, 13, 14, 15], [31, 32, 33, 34, 35, 36, 37]]
NEW = 6


@pytest.fixture(scope="module")
def adapters(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora-sched")
    specs = {"a": dict(rank=4, seed=1), "b": dict(rank=8, seed=2, targets=("q_proj", "v_proj", "gate_proj")),
             "c": dict(rank=6, seed=3, use_rslora=True)}
    models = {name: make_adapter("llama", root / name, **kw) for name, kw in specs.items()}
    return root, models


@pytest.fixture(scope="module")
def expected(adapters):
    """PEFT's greedy continuations of every prompt under every adapter (and the base model)."""
    _, models = adapters
    out = {None: [greedy(base_model("llama"), p, NEW) for p in PROMPTS]}
    for name, model in models.items():
        out[name] = [greedy(model, p, NEW) for p in PROMPTS]
    return out


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(tiny_model_dir("llama"))


def scheduler(tokenizer, root, names=("a", "b", "c"), **kw) -> Scheduler:
    kw.setdefault("max_loras", 3)
    kw.setdefault("dtype", "float32")
    kw.setdefault("max_running_requests", 16)
    cfg = RuntimeConfig(model=str(tiny_model_dir("llama")), max_total_tokens=4096,
                        lora_paths=tuple(f"{n}={root / n}" for n in names),
                        max_lora_rank=8, **kw)
    return Scheduler(cfg, ModelRunner(cfg), tokenizer)


def req(rid: str, i: int, lora: str | None, salt: str | None = None, new: int = NEW) -> GenerateRequest:
    params = SamplingParams(max_new_tokens=new, temperature=0.0, ignore_eos=True)
    return GenerateRequest(rid, list(PROMPTS[i]), params, cache_salt=salt, lora_name=lora)


def control(sched: Scheduler, msg, timeout: float = 60.0) -> LoRAUpdate:
    """Send a LoRA load / unload and step until its reply comes (loads are read on the manager's thread)."""
    sched.handle_message(msg)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for out in list(sched.outbox):
            if getattr(out, "reply_id", None) == msg.reply_id:
                sched.outbox.remove(out)
                return out.payload
        sched.step()
        time.sleep(0.001)
    raise AssertionError(f"no reply to {msg}")


def test_greedy_outputs_equal_peft_in_mixed_batches(adapters, expected, tokenizer):
    root, _ = adapters
    sched = scheduler(tokenizer, root)
    uses = [None, "a", "b", "c"]
    reqs = [req(f"{u}-{i}", i, u) for i in range(len(PROMPTS)) for u in uses]  # all at once: mixed batches
    out = run(sched, reqs)
    for u in uses:
        for i in range(len(PROMPTS)):
            assert out[f"{u}-{i}"]["ids"] == expected[u][i], (u, i)
    assert len({tuple(expected[u][0]) for u in uses}) > 1  # the adapters change the output


def test_cache_is_namespaced_per_adapter_and_salt(adapters, expected, tokenizer):
    root, _ = adapters
    sched = scheduler(tokenizer, root)
    cached = lambda rid, lora, salt=None: run(sched, [req(rid, 0, lora, salt)])[rid]["cached"]  # noqa: E731
    assert cached("a1", "a") == 0
    assert cached("a2", "a") == len(PROMPTS[0]) - 1  # the same adapter reuses its prefix
    assert cached("b1", "b") == 0 and cached("base1", None) == 0  # another adapter, the base model: their own
    assert cached("as1", "a", "salt") == 0 and cached("as2", "a", "salt") > 0  # salt and adapter both hold
    assert cached("bs", "b", "salt") == 0
    out = run(sched, [req("a3", 0, "a")])
    assert out["a3"]["ids"] == expected["a"][0] and out["a3"]["cached"] > 0  # a cache hit changes nothing


def test_more_adapters_than_slots_lru(adapters, expected, tokenizer):
    """Two slots, three adapters, requests of all three at once and in waves: each waits while its adapter is
    read (never failing for it), outputs equal PEFT's, the least recently used idle adapter is replaced."""
    root, _ = adapters
    sched = scheduler(tokenizer, root, max_loras=2)
    info = sched.lora.info()
    assert info["resident"] == ["a", "b"] and set(info["adapters"]) == {"a", "b", "c"}
    reqs = [req(f"{u}-{i}-{w}", i, u) for w in range(2) for u in ("c", "a", "b") for i in range(len(PROMPTS))]
    out = run(sched, reqs)
    for rid, o in out.items():
        u, i, _ = rid.split("-")
        assert o["finish"].kind == "length" and o["ids"] == expected[u][int(i)], rid
    assert sched.lora.loads_from_disk >= 1
    run(sched, [req("c-last", 0, "c")])  # c used last: resident; the other slot holds the one used before
    assert "c" in sched.lora.info()["resident"]
    run(sched, [req("a-last", 1, "a")])
    assert sorted(sched.lora.info()["resident"]) == ["a", "c"]


def test_a_request_waiting_for_its_adapter_does_not_hold_others(adapters, tokenizer):
    root, _ = adapters
    sched = scheduler(tokenizer, root, max_loras=2)  # a and b resident, c not
    sched.handle_message(req("c0", 0, "c"))
    sched.handle_message(req("b0", 1, "b", new=2))
    sched.handle_message(req("base0", 2, None, new=2))
    sched.step()  # c is read into a's slot (the least recently used): b0 and base0 run meanwhile
    assert {r.rid for r in sched.running} == {"b0", "base0"}
    assert [r.rid for r in sched.waits.reqs] == ["c0"] and not sched.waiting  # waits for its adapter's slot
    out = run(sched, [])
    assert out["c0"]["finish"].kind == "length"
    assert sorted(sched.lora.info()["resident"]) == ["b", "c"]


def test_unload_evicts_its_cache_and_lets_running_requests_finish(adapters, expected, tokenizer, tmp_path):
    root, _ = adapters
    sched = scheduler(tokenizer, root)
    run(sched, [req("warm", 0, "a")])
    uid = sched.lora.adapters["a"].uid
    assert any(ns[1] == uid for ns in sched.kv.tree.namespaces() if isinstance(ns, tuple))
    evictable = sched.kv.tree.evictable_size()
    sched.handle_message(req("inflight", 1, "a"))
    for _ in range(3):
        sched.step()  # admitted and decoding
    assert control(sched, UnloadLoRAAdapter(1, "a")).error is None
    assert "a" not in sched.lora.listing()
    assert sched.kv.tree.evictable_size() < evictable  # its finished prefixes went at once
    out = run(sched, [req("after", 0, "a")])  # also steps the in-flight one to its end
    assert out["after"]["finish"].status_code == 400 and "unknown LoRA adapter 'a'" in out["after"]["finish"].message
    assert out["inflight"]["finish"].kind == "length" and out["inflight"]["ids"] == expected["a"][1]
    assert not any(isinstance(ns, tuple) and ns[1] == uid for ns in sched.kv.tree.namespaces())
    assert all(s.entry is None or s.entry.name != "a" for s in sched.lora.slots)
    # the same name again (another folder): a fresh namespace, nothing of the old one reused
    make_adapter("llama", tmp_path / "a2", rank=4, seed=9)
    assert control(sched, LoadLoRAAdapter(2, "a", str(tmp_path / "a2"))).error is None
    out = run(sched, [req("again", 0, "a")])
    assert out["again"]["cached"] == 0


def test_in_flight_request_of_an_unloaded_adapter_finishes_right(adapters, expected, tokenizer):
    root, _ = adapters
    sched = scheduler(tokenizer, root)
    sched.handle_message(req("inflight", 1, "b"))
    outs = []
    for _ in range(2):
        sched.step()
        outs += [o for o in sched.outbox if isinstance(o, ReqOutput)]
        sched.outbox.clear()
    sched.handle_message(UnloadLoRAAdapter(7, "b"))
    out = run(sched, [])
    ids = [t for o in outs for t in o.new_ids] + out["inflight"]["ids"]
    assert ids == expected["b"][1] and out["inflight"]["finish"].kind == "length"


def test_pinned_adapter_stays_resident(adapters, tokenizer):
    root, _ = adapters
    sched = scheduler(tokenizer, root, names=("b",), max_loras=2, lora_target_modules=("all",))
    assert control(sched, LoadLoRAAdapter(1, "a", str(root / "a"), pinned=True)).error is None
    err = control(sched, LoadLoRAAdapter(2, "x", str(root / "c"), pinned=True)).error
    assert "at most max_loras - 1 = 1 adapters may be pinned" in err
    assert control(sched, LoadLoRAAdapter(3, "c", str(root / "c"))).error is None
    for w in range(2):
        run(sched, [req(f"b{w}", 0, "b"), req(f"c{w}", 1, "c")])
        assert "a" in sched.lora.info()["resident"]


def test_bad_adapters_are_refused_by_name_and_nothing_leaks(adapters, expected, tokenizer, tmp_path):
    root, _ = adapters
    sched = scheduler(tokenizer, root, names=("b",), lora_target_modules=("q_proj", "k_proj", "v_proj", "o_proj",
                                                                          "gate_proj", "up_proj"))
    make_adapter("llama", tmp_path / "r16", rank=16, seed=4)
    make_adapter("llama-hd64", tmp_path / "other", rank=4, seed=5)
    make_adapter("llama", tmp_path / "down", rank=4, seed=6, targets=("down_proj",))
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 4, "target_modules": ["q_proj"]}))
    (broken / "adapter_model.safetensors").write_bytes(b"\x00garbage")
    lm_head = tmp_path / "lm_head"
    lm_head.mkdir()
    (lm_head / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 4,
                                                             "target_modules": ["lm_head"]}))
    cases = [
        ("r16", tmp_path / "r16", "rank 16 exceeds max_lora_rank 8"),
        ("other", tmp_path / "other", "the model's maps"),
        ("down", tmp_path / "down", "target modules ['down_proj'] are not among"),
        ("broken", broken, "broken adapter_model.safetensors"),
        ("lm", lm_head, "unknown target modules ['lm_head']"),
        ("gone", tmp_path / "nowhere", "no adapter_config.json"),
        ("b", root / "c", "'b' is already loaded"),
        ("bad name!", root / "c", "1-128 letters"),
    ]
    sched.handle_message(req("alongside", 2, "b"))
    for k, (name, path, message) in enumerate(cases):
        update = control(sched, LoadLoRAAdapter(k, name, str(path)))
        assert update.error is not None and message in update.error, (name, update.error)
        assert set(update.adapters) == {"b"}
    out = run(sched, [req("base", 0, None)])
    assert out["base"]["ids"] == expected[None][0]
    assert out["alongside"]["ids"] == expected["b"][2]
    assert sched.lora.listing().keys() == {"b"} and not sched.lora.registrations
    assert control(sched, UnloadLoRAAdapter(99, "nope")).error.startswith("no LoRA adapter named 'nope'")


def test_an_adapter_that_breaks_on_disk_fails_only_its_requests(adapters, expected, tokenizer, tmp_path):
    root, _ = adapters
    make_adapter("llama", tmp_path / "d", rank=4, seed=7)
    sched = scheduler(tokenizer, root, names=("a", "b"), max_loras=2)
    assert control(sched, LoadLoRAAdapter(1, "d", str(tmp_path / "d"))).error is None  # not resident: no slot
    (tmp_path / "d" / "adapter_model.safetensors").write_bytes(b"")
    out = run(sched, [req("d0", 0, "d"), req("a0", 1, "a")])
    assert out["d0"]["finish"].status_code == 500 and "'d' could not be read" in out["d0"]["finish"].message
    assert out["a0"]["ids"] == expected["a"][1]


# bf16: the fused step verifies several rows a request (without it, on a CPU lacking AVX512-BF16, torch's bf16
# matmuls round differently at different row counts, so greedy outputs of a random tiny model may part); the draft
# model drafts without the adapters
@pytest.mark.parametrize("dtype, spec", [("float32", {"speculative_algorithm": "ngram"}),
                                         pytest.param("bfloat16", {"speculative_algorithm": "ngram"},
                                                      marks=pytest.mark.skipif(
                                                          not (cpu.available() and cpu.lib().has_decode_step),
                                                          reason="the fused bf16 step needs AVX512-BF16")),
                                         ("float32", {"speculative_draft_model": str(tiny_model_dir("llama"))})])
def test_speculation_keeps_each_adapters_greedy_output(adapters, tokenizer, dtype, spec):
    """Speculation over mixed adapters: a verification's rows take their request's adapter, so the outputs
    are those without speculation, token for token."""
    root, _ = adapters
    uses = [None, "a", "b", "c"]
    looping = [[5, 9, 13, 17, 5, 9, 13, 17, 5, 9, 13], [11, 12, 13, 11, 12, 13, 11, 12], list(PROMPTS[2])]

    def outputs(**kw):
        sched = scheduler(tokenizer, root, dtype=dtype, **kw)
        if "speculative_draft_model" in kw:
            sched.spec.drafter.forward_cost = 0.0  # draft although a draft as large as the target does not pay
        params = SamplingParams(max_new_tokens=12, temperature=0.0, ignore_eos=True)
        reqs = [GenerateRequest(f"{u}-{i}", list(p), params, lora_name=u) for i, p in enumerate(looping) for u in uses]
        return run(sched, reqs), sched.counters

    plain, _ = outputs()
    drafted, counters = outputs(**spec)
    assert counters.spec_draft_tokens > 0
    assert {rid: o["ids"] for rid, o in drafted.items()} == {rid: o["ids"] for rid, o in plain.items()}


def test_an_abort_while_waiting_for_an_adapter_leaks_no_slot(adapters, tokenizer):
    """Aborted while its adapter is read from disk, and aborted while holding its slot in the queue: nothing stays
    held (slot references, adapter users) and the read still ends up in its slot."""
    root, _ = adapters
    sched = scheduler(tokenizer, root, max_loras=2)  # a and b resident, c not
    sched.handle_message(req("c0", 0, "c"))
    sched.step()  # c's read starts: c0 waits for its slot
    assert [r.rid for r in sched.waits.reqs] == ["c0"]
    sched.handle_message(AbortRequest("c0"))
    out = run(sched, [])
    assert out["c0"]["finish"] == FinishReason.abort("aborted by the client")
    deadline = time.monotonic() + 60
    while sched.lora.busy and time.monotonic() < deadline:
        sched.step()
        time.sleep(0.01)
    assert sorted(sched.lora.info()["resident"]) == ["b", "c"]
    # max_running_requests=1: b1 holds its adapter's slot in the queue behind b0, then is aborted there
    sched = scheduler(tokenizer, root, max_loras=2, max_running_requests=1)
    sched.handle_message(req("b0", 1, "b", new=4))
    sched.handle_message(req("b1", 2, "b"))
    sched.step()
    assert [r.rid for r in sched.running] == ["b0"] and [r.rid for r in sched.waiting] == ["b1"]
    assert sched.waiting[0].lora_slot >= 0
    sched.handle_message(AbortRequest("b1"))
    out = run(sched, [])
    assert out["b1"]["finish"] == FinishReason.abort("aborted by the client") and out["b0"]["finish"].kind == "length"
    assert all(s.refs == 0 for s in sched.lora.slots) and all(e.users == 0 for e in sched.lora.adapters.values())


def test_the_disk_tier_keeps_each_adapters_pages_apart(adapters, expected, tokenizer, tmp_path):
    """Pages written under an adapter are named by its weights' digest: a restarted server finds them for that
    adapter (under any name: the same weights), never for the base model or another adapter."""
    root, _ = adapters
    tiers = dict(kv_cache_dir=str(tmp_path), page_size=4, hicache_write_policy="write_through",
                 hicache_kv_format="model")
    first = scheduler(tokenizer, root, **tiers)
    out = run(first, [req("a-0", 0, "a")])
    assert out["a-0"]["ids"] == expected["a"][0]
    first.kv.hicache.disk.drain()
    assert first.server_info()["hicache"]["disk"]["pages_written"] > 0
    cfg = first.cfg
    # a restart with the same adapters, and "a" once more under another name (the same folder: the same weights)
    second = Scheduler(RuntimeConfig(**{**cfg.__dict__, "lora_paths": (*cfg.lora_paths, f"again={root / 'a'}")}),
                       ModelRunner(cfg), tokenizer)
    res = {}
    for rid, lora in (("base", None), ("b", "b"), ("a", "a"), ("again", "again")):
        res[rid] = run(second, [req(rid, 0, lora)])[rid]
        assert res[rid]["ids"] == expected["a" if lora == "again" else lora][0], rid
    assert res["base"]["cached"] == 0 and res["b"]["cached"] == 0  # never another adapter's or the base's pages
    assert res["a"]["cached"] >= 4  # the adapter's own pages, from disk
    assert second.server_info()["hicache"]["disk_hit_tokens"] >= 4
    assert res["again"]["cached"] >= 4  # (from the tree or disk: "again" has its own namespace in the tree)
