"""The window group's KV (ground/window_kv.py, scheduler/window_kv.py): window layers keep only their last W tokens
in a smaller pool of their own. The layout's choice and sizing, the pool's tokens per byte against every layer
keeping every token, a prompt far longer than the window pool through the scheduler (ids equal transformers'),
hits shortened where the window layers lack a hit's last W tokens and whole again once recomputed, speculation's
rejected drafts, and eviction giving every window slot back."""

from __future__ import annotations

import pytest
import torch
from test_scheduler import make_scheduler, run
from test_window_models import greedy_ref, reference
from tiny_models import WINDOW, tiny_window_model_dir

from radixgen.common.sampling_params import SamplingParams
from radixgen.runtime.ground.kv_pool import KVPool
from radixgen.runtime.ground.window_kv import slots_from_bytes, window_floor, window_layout, window_slots_for
from radixgen.runtime.loader import load_tokenizer
from radixgen.runtime.scheduler.request import GenerateRequest
from radixgen.runtime.scheduler.window_kv import WindowSlots

FULL, CHUNK, RUNNING = 256, 5, 2  # the scheduler's full pool, prefill chunk and running requests
PARAMS = SamplingParams(max_new_tokens=6, temperature=0.0, ignore_eos=True)


def plan(windows, **kw):
    args = dict(hierarchical_cache=False, world_size=1, page_size=1, shares_table=False, chunked_prefill=True)
    return window_layout(windows, 4096, **{**args, **kw})


def test_the_layout_is_chosen_where_it_applies_and_says_why_not():
    p, why = plan((8, 0, 8, 0))
    assert why is None and p.window == 8 and p.layers == (True, False, True, False)
    assert (p.num_full_layers, p.num_window_layers) == (2, 2)
    assert plan((0, 0)) == (None, None) and plan((4096, 0)) == (None, None)  # a window no context fills: none
    for kw, words in [({"hierarchical_cache": True}, "host / disk tiers"), ({"world_size": 2}, "world size 2"),
                      ({"page_size": 4}, "page_size 4"), ({"shares_table": True}, "draft model"),
                      ({"chunked_prefill": False}, "chunked prefill off")]:
        p, why = plan((8, 0), **kw)
        assert p is None and words in why
    p, why = plan((8, 16, 0))
    assert p is None and "2 different windows [8, 16]" in why


@pytest.mark.parametrize("full_layers,window_layers", [(12, 12), (4, 20), (0, 24)])
def test_a_byte_budget_holds_more_tokens_than_every_layer_keeping_every_token(full_layers, window_layers):
    """gpt-oss's half, Gemma 3's 5 in 6 and Mistral's all-window layers: the same bytes hold more tokens of
    context, within the budget, the window pool at least its floor."""
    per_layer = KVPool.bytes_per_slot(1, 8, 64, torch.bfloat16)
    budget = 2 * 2**30
    before = budget // (per_layer * (full_layers + window_layers))
    full, win = slots_from_bytes(budget, per_layer * full_layers, per_layer * window_layers, 128, 512, 128)
    assert full > before and win >= window_floor(128, 512, 128)
    assert full * per_layer * full_layers + win * per_layer * window_layers <= budget
    assert window_slots_for(100_000, 128, 512, 128) == 25_000 and window_slots_for(1000, 128, 512, 8) == 1000


def test_usable_hit_lengths():
    """A hit of L tokens is usable where the window layers hold [L - W, L); a match is shortened to the longest."""
    w = WindowSlots(3, 16, torch.zeros(2, 16, dtype=torch.int64), CHUNK, torch.zeros(2, 16, dtype=torch.int64), 32)
    slots = torch.arange(1, 11)  # positions 0..9
    w.of[slots] = torch.tensor([1, 2, 0, 0, 5, 6, 7, 0, 9, 10])  # holes at positions 2, 3 and 7
    assert w.usable_len(slots) == 7  # [4, 7) held; 8, 9 and 10 need position 7
    assert w.usable_len(slots[:2]) == 2 and w.usable_len(slots[:0]) == 0
    w.of[slots[7]] = 8
    assert w.usable_len(slots) == 10


@pytest.fixture(scope="module")
def gpt_oss():
    folder = tiny_window_model_dir("gpt_oss")
    sched = make_scheduler(folder, load_tokenizer(str(folder)), chunked_prefill_size=CHUNK, max_total_tokens=FULL,
                           max_running_requests=RUNNING)
    return sched, reference(folder)


def ids(n: int, seed: int) -> list[int]:
    return torch.randint(3, 49152, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_the_runner_keeps_window_layers_in_a_smaller_pool(gpt_oss):
    sched, _ = gpt_oss
    runner, kv = sched.runner, sched.kv
    pool, plan_ = runner.kv_pool, runner.window_plan
    assert plan_.window == WINDOW and plan_.layers == (True, False)
    win = window_slots_for(FULL, WINDOW, CHUNK, RUNNING)
    assert pool.window_slots == win + 1 < pool.num_slots == FULL + 1
    assert [b.shape[0] for b in pool.k_buffers] == [win + 1, FULL + 1]
    # tokens of context per byte: more than every layer keeping every token
    assert FULL / pool.nbytes() > 1 / KVPool.bytes_per_slot(2, *pool.k_buffers[1].shape[1:], pool.dtype)
    assert kv.usage()["window"] == {"window": WINDOW, "free": win, "held": 0, "total": win}
    with pytest.raises(ValueError, match="rows of two kinds"):
        pool.read_rows(torch.tensor([1]))


def test_a_prompt_longer_than_the_window_pool(gpt_oss):
    """A 150-token prompt in chunks of 5 and its decode through a window pool of 64 slots: the window group's
    slots stay bounded (the cached prompt's older ones swept), the ids are transformers'."""
    sched, ref = gpt_oss
    held = []
    step = sched.step

    def watched():
        ran = step()
        held.append(sched.kv.usage()["window"]["held"])
        return ran

    sched.step = watched
    try:
        prompt = ids(150, 41)
        assert len(prompt) > sched.kv.window.capacity
        out = run(sched, [GenerateRequest("long", prompt, PARAMS)])
    finally:
        del sched.step
    assert out["long"]["ids"] == greedy_ref(ref, prompt, PARAMS.max_new_tokens)
    assert max(held) <= sched.kv.window.capacity
    assert held[-1] >= WINDOW  # the finished request's tail stays cached
    sched.kv.flush()


def test_hits_shortened_then_whole_and_eviction_gives_window_slots_back(gpt_oss):
    sched, ref = gpt_oss
    kv = sched.kv
    head = ids(4 * WINDOW, 43)
    ps = [head + ids(3, 44 + i) for i in range(3)]
    first = run(sched, [GenerateRequest("h0", ps[0], PARAMS)])
    kv.window.sweep(kv.tree)  # as a short pool would: only the cached path's last W positions keep window slots
    assert kv.usage()["window"]["held"] == WINDOW
    second = run(sched, [GenerateRequest("h1", ps[1], PARAMS)])
    assert second["h1"]["cached"] < len(head)  # the head's last W had gone: the hit is shortened
    third = run(sched, [GenerateRequest("h2", ps[2], PARAMS)])
    assert third["h2"]["cached"] >= len(head)  # h1 gave the head's end its window slots back
    for rid, p in zip(("h0", "h1", "h2"), ps, strict=True):
        assert {**first, **second, **third}[rid]["ids"] == greedy_ref(ref, p, PARAMS.max_new_tokens)
    kv.flush()
    w = kv.usage()["window"]
    assert (w["held"], w["free"]) == (0, w["total"]) and kv.invariant_holds()


def test_speculation_with_window_layers():
    """ngram drafts (a repeating prompt, so some are accepted and some rejected: free_tail over window slots)."""
    folder = tiny_window_model_dir("gpt_oss")
    sched = make_scheduler(folder, load_tokenizer(str(folder)), chunked_prefill_size=CHUNK, max_total_tokens=FULL,
                           max_running_requests=RUNNING, speculative_algorithm="ngram")
    assert sched.runner.window_plan is not None
    prompt = ids(7, 47) * 4
    params = SamplingParams(max_new_tokens=12, temperature=0.0, ignore_eos=True)
    out = run(sched, [GenerateRequest("s", prompt, params)])
    assert out["s"]["ids"] == greedy_ref(reference(folder), prompt, 12)


def test_the_pool_reports_both_groups(gpt_oss):
    sched, _ = gpt_oss
    info = sched.runner.kv_cache_info()
    w = info["window"]
    assert (info["capacity_tokens"], w["capacity_tokens"], w["window"], w["layers"]) == \
        (FULL, sched.kv.window.capacity, WINDOW, 1)
    assert info["memory_bytes"] == sched.runner.kv_pool.nbytes() == \
        (FULL + 1) * info["bytes_per_token"] + (w["capacity_tokens"] + 1) * w["bytes_per_token"]


def test_a_running_request_holds_its_window_and_a_chunk():
    """No radix cache: a 150-token prompt and its decode hold at most W + a chunk of window slots at every step
    (what the request frees behind itself), in a window pool smaller than the prompt."""
    folder = tiny_window_model_dir("gpt_oss")
    sched = make_scheduler(folder, load_tokenizer(str(folder)), chunked_prefill_size=CHUNK, max_total_tokens=FULL,
                           max_running_requests=RUNNING, disable_radix_cache=True)
    held, step = [], sched.step

    def watched():
        ran = step()
        held.append(sched.kv.usage()["window"]["held"])
        return ran

    sched.step = watched
    prompt = ids(150, 53)
    out = run(sched, [GenerateRequest("alone", prompt, PARAMS)])
    assert out["alone"]["ids"] == greedy_ref(reference(folder), prompt, PARAMS.max_new_tokens)
    assert WINDOW <= max(held) <= WINDOW + CHUNK and held[-1] == 0
