"""The hierarchical cache behind the real HTTP server (tiny random Llama, a 160-token pool): a prefix evicted by
other traffic comes back from the host tier, and `meta_info.cached_tokens_details`, /metrics and /get_server_info
say which tier served it (the web console's document shows the tiers too); a restarted server over the same
--kv-cache-dir serves its first request's prefix from the disk tier, with the same greedy output."""

from __future__ import annotations

import httpx
import pytest
import torch
from server_proc import start_server, stop_server
from tiny_models import tiny_model_dir

PREFIX = torch.randint(3, 49152, (96,), generator=torch.Generator().manual_seed(5)).tolist()


def flags(kv_dir) -> list[str]:
    return ["--model", str(tiny_model_dir("llama")), "--dtype", "float32", "--max-total-tokens", "160",
            "--page-size", "8", "--kv-cache-dir", str(kv_dir), "--hicache-write-policy", "write_through",
            "--hicache-kv-format", "model"]


def gen(http: httpx.Client, ids: list[int]) -> dict:
    r = http.post("/generate", json={"input_ids": ids, "sampling_params": {"max_new_tokens": 4, "temperature": 0,
                                                                          "ignore_eos": True}})
    assert r.status_code == 200, r.text
    return r.json()


@pytest.fixture(scope="module")
def kv_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("kv")


def test_tiers_in_meta_info_metrics_server_info_and_after_a_restart(kv_dir):
    srv = start_server(*flags(kv_dir), api_key=None)
    try:
        with srv.client() as http:
            first = gen(http, PREFIX + [7, 8, 9])
            for seed in range(2):  # other traffic evicts the prefix from the 160-token pool (not from the host)
                other = torch.randint(3, 49152, (90,), generator=torch.Generator().manual_seed(100 + seed)).tolist()
                gen(http, other)
            again = gen(http, PREFIX + [7, 8, 9])
            assert again["output_ids"] == first["output_ids"]
            meta = again["meta_info"]
            details = meta["cached_tokens_details"]
            assert meta["cached_tokens"] >= 96 and details["host"] > 0, meta
            assert sum(details.values()) == meta["cached_tokens"]
            info = http.get("/get_server_info").json()["hicache"]
            assert info["host_hit_tokens"] >= details["host"] and info["disk"]["enabled"]
            assert info["disk"]["pages_written"] > 0
            text = http.get("/metrics").text
            assert 'radixgen_prefix_cache_hit_tokens_by_tier_total{tier="host"}' in text
            assert "radixgen_hicache_disk_enabled 1" in text
            tiers = http.get("/v1/radix_tree").json()["tiers"]  # the web console's line under the pool bar
            assert tiers["host_used"] > 0 and tiers["disk_enabled"] and tiers["disk_pages"] > 0
    finally:
        assert stop_server(srv) == 0, srv.log_tail()
    # a restart: the new server's very first request finds the prefix on disk
    srv = start_server(*flags(kv_dir), api_key=None)
    try:
        with srv.client() as http:
            out = gen(http, PREFIX + [7, 8, 9])
            assert out["output_ids"] == first["output_ids"]
            assert out["meta_info"]["cached_tokens_details"]["disk"] >= 88, out["meta_info"]
            assert http.get("/get_server_info").json()["hicache"]["disk"]["read_failures"] == 0
    finally:
        assert stop_server(srv) == 0, srv.log_tail()
