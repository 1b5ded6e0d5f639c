"""The web console behind the router: its page and files come from the router itself, and its
/v1/radix_tree lists every worker's tree (each worker's own prefixes under its URL), in the browser too."""

from __future__ import annotations

import uuid

import httpx
import pytest
from browser import launch_browser, open_console, screenshot
from router_proc import start_router, stop_router
from server_proc import API_KEY

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def router(workers):
    r = start_router([w.url for w in workers])
    yield r
    assert stop_router(r) == 0, r.log_tail()


def _cache_on(worker, word: str) -> None:
    with worker.client() as c:  # straight to the worker: the prefix is cached there and nowhere else
        # an empty tree first: no earlier prompt shares the word's first tokens (which would split it between edges)
        assert c.post("/flush_cache", params={"timeout": 60}).status_code == 200
        r = c.post("/generate", json={"text": f"{word} counts the lighthouses of the coast. " * 5,
                                      "sampling_params": {"max_new_tokens": 1}})
        assert r.status_code == 200, r.text


def test_router_aggregates_the_workers_trees(router, workers):
    words = ["Wombat" + uuid.uuid4().hex[:6] for _ in workers]
    for worker, word in zip(workers, words, strict=True):
        _cache_on(worker, word)
    assert httpx.get(router.url + "/").status_code == 200  # the page needs no key
    assert httpx.get(router.url + "/console/app.js").status_code == 200
    assert httpx.get(router.url + "/v1/radix_tree").status_code == 401  # the data does (the workers' key)
    with router.client(api_key=API_KEY) as c:
        doc = c.get("/v1/radix_tree", params={"max_nodes": 500}).json()
        by_url = {w["url"]: w for w in doc["workers"]}
        assert sorted(by_url) == sorted(w.url for w in workers)
        for worker, word in zip(workers, words, strict=True):
            texts = " ".join(n["text"] or "" for n in by_url[worker.url]["doc"]["tree"]["nodes"])
            other = words[1 - workers.index(worker)]
            assert word in texts and other not in texts
        bad = c.get("/v1/radix_tree", params={"max_nodes": 0})
        assert bad.status_code == 400 and "max_nodes" in bad.json()["error"]["message"]

    with launch_browser() as browser:
        page = open_console(browser, API_KEY)
        try:
            page.goto(router.url + "/#runtime")
            page.fill("#max-nodes", "500")
            for worker, word in zip(workers, words, strict=True):
                section = page.locator(f".worker[data-url='{worker.url}']")
                section.locator(".tree .node", has_text=word).first.wait_for()
                assert worker.url in section.locator(".worker-title").inner_text()
            screenshot(page, "console-router")
            assert not page.errors, page.errors
        finally:
            page.context.close()
