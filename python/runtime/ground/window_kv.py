"""Sliding-window layers' own KV: the layout of a pool whose window layers keep only their last W tokens.

A model's layers form two groups: the full group (layers with no window, which keep every token) and the window
group (layers with one sliding window W, where the query at position i reads only (i - W, i]). The full group's
slots are the tokens' identity (the radix tree, the request->slot table); the window group has its own, smaller
buffers, its own free-slot allocator and its own request->slot table (the window table), in which only a
request's last W (+ the step's) positions point at live rows. The scheduler's KV cache manager
(scheduler/window_kv.py) keeps the window slots; this module decides the layout and sizes it.

The window pool holds a quarter of the full pool's tokens (WINDOW_POOL_SHARE), and never less than two requests'
window and chunk plus a slot per running request: a request longer than 4 W costs the window group less than the
share, a shorter one more (then admission waits, or eviction frees cached window tails first).
"""

from __future__ import annotations

import logging
from typing import NamedTuple

from radixgen.runtime.ground.kv_pool import KVPool

WINDOW_POOL_SHARE = 4  # the window pool's tokens: the full pool's / this (at least window_floor's)
logger = logging.getLogger(__name__)
MAX_FULL_SLOTS = 262144  # the full pool's slots when no layer is a full one (they cost no memory then)


class WindowPlan(NamedTuple):
    """Which of this rank's layers keep only their last `window` tokens (the window group)."""

    window: int
    layers: tuple[bool, ...]  # per local layer: in the window group

    @property
    def num_window_layers(self) -> int:
        return sum(self.layers)

    @property
    def num_full_layers(self) -> int:
        return len(self.layers) - self.num_window_layers


def plan_window_kv(windows: tuple[int, ...], context_length: int, *, hierarchical_cache: bool, world_size: int,
                   page_size: int, shares_table: bool, chunked_prefill: bool) -> WindowPlan | None:
    """The window layout for a model whose local layers have `windows` (0: full attention), or None (a warning
    says why where some layer has a window the context can fill). The cases it does not cover keep every token in
    every layer (the window is then a mask only, as correct and without the memory saving)."""
    plan, why = window_layout(windows, context_length, hierarchical_cache, world_size, page_size, shares_table,
                      chunked_prefill)
    if why is not None:
        logger.warning("window layers keep every token (a mask only, no memory saved): %s", why)
    return plan


def window_layout(windows: tuple[int, ...], context_length: int, hierarchical_cache: bool, world_size: int,
                  page_size: int, shares_table: bool, chunked_prefill: bool) -> tuple[WindowPlan | None, str | None]:
    """plan_window_kv's answer and why it is None ((None, None): no layer has a window the context can fill)."""
    sizes = {w for w in windows if 0 < w < context_length}
    if not sizes:
        return None, None
    if len(sizes) > 1:
        return None, f"the layers have {len(sizes)} different windows {sorted(sizes)} (one window group is built)"
    why = ("the hierarchical cache's host / disk tiers" if hierarchical_cache else
           f"tensor / pipeline parallelism (world size {world_size})" if world_size > 1 else
           f"page_size {page_size} (the window group keeps whole tokens)" if page_size != 1 else
           "a draft model sharing the target's slot table" if shares_table else
           "chunked prefill off (a prompt's window need is its length)" if not chunked_prefill else None)
    if why is not None:
        return None, f"{why} with window layers"
    (window,) = sizes
    return WindowPlan(window, tuple(0 < w < context_length for w in windows)), None


def window_floor(window: int, chunk: int, max_running: int) -> int:
    """The fewest window slots the pool gets: two requests' window and prefill chunk, and a slot per request."""
    return 2 * (window + chunk) + max_running


def window_slots_for(full_slots: int, window: int, chunk: int, max_running: int) -> int:
    """The window pool's slots (without the padding slot) beside a full pool of `full_slots`."""
    return min(full_slots, max(full_slots // WINDOW_POOL_SHARE, window_floor(window, chunk, max_running)))


def slots_from_bytes(budget: int, full_bytes: int, window_bytes: int, window: int, chunk: int,
                     max_running: int) -> tuple[int, int]:
    """(full slots, window slots) a memory budget holds, where a full slot costs `full_bytes` (every full layer's K
    and V of a token) and a window slot `window_bytes`. The window pool is window_slots_for's share of the full."""
    if full_bytes == 0:  # no full layer: the full slots are only the tokens' names
        return MAX_FULL_SLOTS, max(1, min(MAX_FULL_SLOTS, budget // window_bytes))
    floor = window_floor(window, chunk, max_running)
    full = budget // (full_bytes + window_bytes // WINDOW_POOL_SHARE)
    if full // WINDOW_POOL_SHARE < floor:
        full = (budget - floor * window_bytes) // full_bytes
    full = max(1024, min(full, MAX_FULL_SLOTS))
    return full, window_slots_for(full, window, chunk, max_running)


def pool_slots(plan: WindowPlan, max_total_tokens: int, budget: int, per_layer_bytes: int, chunk: int,
               max_running: int) -> tuple[int, int]:
    """(full slots, window slots) of a pool with a window group: `max_total_tokens` full slots and the window
    pool's share of them, else (0) what `budget` bytes hold at `per_layer_bytes` per token and layer."""
    if max_total_tokens:
        return max_total_tokens, window_slots_for(max_total_tokens, plan.window, chunk, max_running)
    return slots_from_bytes(budget, per_layer_bytes * plan.num_full_layers, per_layer_bytes * plan.num_window_layers,
                            plan.window, chunk, max_running)


def window_info(plan: WindowPlan | None, pool: KVPool, head_dim: int) -> dict:
    """The pool's report for get_server_info: with a window group, bytes_per_token is the full layers' and
    `window` says the window layers' pool (nothing without one)."""
    if plan is None:
        return {}
    heads = pool.k_buffers[0].shape[1]

    def per_token(layers: int) -> int:
        return KVPool.bytes_per_slot(layers, heads, head_dim, pool.dtype, pool.code_dtype)

    return {"bytes_per_token": per_token(plan.num_full_layers),
            "window": {"window": plan.window, "layers": plan.num_window_layers,
                       "capacity_tokens": pool.window_slots - 1, "bytes_per_token": per_token(plan.num_window_layers)}}
