"""The web console: its static page at `/` (radixgen.common.console_static: files in common/console/, shipped as package
data, no build step) and the
JSON document it polls, `/v1/radix_tree`: a bounded snapshot of the radix cache (scheduler/radix/snapshot.py)
with the KV pool's usage by state, the queues and the cumulative counters the page turns into rates.

The page and its scripts hold no secret and are served without the API key (middleware.OPEN_PATHS /
OPEN_PREFIXES), so a browser can load them and then ask for the key; `/v1/radix_tree` needs the key like every
other route, and under per-key isolation shows only the asking key's namespaces."""

from __future__ import annotations

import asyncio
import time
from typing import Any

from fastapi import APIRouter, Query
from starlette.responses import Response

from radixgen.common.console_static import add_console_static
from radixgen.common.http_errors import JSONResponse, error_of
from radixgen.runtime.engine.core import TREE_LIMITS
from radixgen.runtime.server.middleware import KEY_NAMESPACE


def pool_usage(cache: dict[str, int]) -> dict[str, int]:
    """The KV pool by state: `running` slots belong to running requests (their own and the cached prefixes they
    hold locked), `cached` ones hold unlocked prefixes (evicted on demand), `free` ones nothing."""
    return {"running": cache["total"] - cache["free"] - cache["evictable"], "cached": cache["evictable"],
            "free": cache["free"], "total": cache["total"], "shared_locked": cache["protected"]}


def runtime_view(info: dict[str, Any]) -> dict[str, Any]:
    """The part of the server info the console shows; counters are cumulative (the page takes differences)."""
    stats = info.get("stats", {})
    return {
        "pool": pool_usage(info["cache"]),
        "queues": {"running": info.get("num_running", 0), "waiting": info.get("num_waiting", 0)},
        "counters": {k: stats.get(k, 0) for k in ("num_requests", "prompt_tokens", "cached_tokens",
                                                  "generation_tokens", "evicted_tokens")},
        "cache_hit_rate": info.get("cache_hit_rate", 0.0),
        "tiers": tier_usage(info.get("hicache")),
    }


def tier_usage(hicache: dict[str, Any] | None) -> dict[str, Any] | None:
    """The hierarchical cache's lower tiers under the pool bar (None: it is off)."""
    if not hicache:
        return None
    host, disk = hicache["host"], hicache.get("disk")
    return {"host_used": host["used_tokens"], "host_total": host["capacity_tokens"],
            "disk_pages": disk["pages"] if disk else None, "disk_enabled": bool(disk and disk["enabled"])}


def console_router(engine: Any, model_name: str) -> APIRouter:
    router = APIRouter()
    add_console_static(router)

    @router.get("/v1/radix_tree")
    async def radix_tree(max_nodes: int = Query(64, ge=1, le=TREE_LIMITS["max_nodes"]),
                         max_depth: int = Query(12, ge=1, le=TREE_LIMITS["max_depth"]),
                         preview_chars: int = Query(48, ge=1, le=TREE_LIMITS["preview_chars"])) -> Response:
        viewer = KEY_NAMESPACE.get()
        try:  # off the event loop: two round trips to the scheduler must not stall the streams
            tree = await asyncio.to_thread(engine.get_radix_tree, max_nodes, max_depth, preview_chars, viewer)
            info = await asyncio.to_thread(engine.get_server_info)
        except Exception as e:  # noqa: BLE001 - a RequestError is a 400, a dead scheduler a 503
            raise error_of(e) from e
        return JSONResponse({"object": "radix_tree", "time": time.time(), "model": model_name,
                             "isolated": viewer is not None, "tree": tree.to_json(), **runtime_view(info)})

    return router
