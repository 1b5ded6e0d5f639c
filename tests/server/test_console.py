"""The web console served at `/` by a real `radixgen serve` on the default model: its JSON endpoint
(/v1/radix_tree) over HTTP, then the page itself in a real headless browser (Python playwright driving
Debian's Chromium): it loads without console errors, a chat streams an answer with its cached-token count,
a JSON-schema answer parses, and the runtime view draws the prefix a request just cached. One screenshot per
view goes to build/screenshots/ (the paths are printed: run with -s to see them)."""

from __future__ import annotations

import json
import uuid

import httpx
import jsonschema
import pytest
from browser import launch_browser, open_console, screenshot

pytestmark = pytest.mark.slow

SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                           "country": {"type": "string", "maxLength": 20}},
          "required": ["city", "country"], "additionalProperties": False}


def _flush(client: httpx.Client) -> None:
    assert client.post("/flush_cache", params={"timeout": 60}).status_code == 200


def _marker_prompt() -> tuple[str, str]:
    """A new prompt whose first tree edge starts with its marker word, once the cache holds no earlier marker
    prompt (one would share the word's first tokens and split it between two edges): flush before."""
    word = "Quokka" + uuid.uuid4().hex[:6]
    return word, f"{word} keeps a diary of the tides at the northern pier. " * 6


# ------------------------------------------------------------------ HTTP


def test_static_files_are_served_without_the_key_and_nothing_else(server):
    page = httpx.get(server.url + "/", timeout=30)
    assert page.status_code == 200 and "text/html" in page.headers["content-type"]
    assert "/console/app.js" in page.text
    for name, kind in (("app.js", "javascript"), ("style.css", "text/css"), ("tree.js", "javascript")):
        r = httpx.get(f"{server.url}/console/{name}", timeout=30)
        assert r.status_code == 200 and kind in r.headers["content-type"], name
    assert httpx.get(server.url + "/console/index.html.bak", timeout=30).status_code == 404
    assert httpx.get(server.url + "/console/..%2Fapp.py", timeout=30).status_code == 404
    assert httpx.get(server.url + "/v1/radix_tree", timeout=30).status_code == 401  # the data needs the key


def test_radix_tree_endpoint_shows_a_cached_prefix(server):
    with server.client() as c:
        _flush(c)
        word, prompt = _marker_prompt()
        r = c.post("/generate", json={"text": prompt, "sampling_params": {"max_new_tokens": 2, "temperature": 0}})
        assert r.status_code == 200, r.text
        prompt_tokens = r.json()["meta_info"]["prompt_tokens"]
        again = c.post("/generate", json={"text": prompt, "sampling_params": {"max_new_tokens": 2}})
        assert again.json()["meta_info"]["cached_tokens"] > 0
        doc = c.get("/v1/radix_tree", params={"max_nodes": 500, "max_depth": 64, "preview_chars": 200}).json()
        mine = [n for n in doc["tree"]["nodes"] if n["text"] and word in n["text"]]
        assert mine, [n["text"] for n in doc["tree"]["nodes"]]
        node = mine[0]
        assert node["prefix_len"] + node["subtree_tokens"] >= prompt_tokens  # the whole prompt is below it
        assert node["hits"] >= 1  # the second request reused it
        pool = doc["pool"]
        assert pool["running"] + pool["cached"] + pool["free"] == pool["total"] and pool["cached"] >= prompt_tokens
        assert doc["counters"]["cached_tokens"] > 0 and set(doc["queues"]) == {"running", "waiting"}
        small = c.get("/v1/radix_tree", params={"max_nodes": 1, "max_depth": 1}).json()["tree"]
        assert len(small["nodes"]) == 1 and small["truncated"] == (small["total_nodes"] > 1)
        for bad in ({"max_nodes": 0}, {"max_nodes": 501}, {"max_depth": "deep"}, {"preview_chars": 10_000}):
            r = c.get("/v1/radix_tree", params=bad)
            assert r.status_code == 400, (bad, r.text)
            assert next(iter(bad)) in r.json()["error"]["message"]


# ------------------------------------------------------------------ the page in a browser


@pytest.fixture(scope="module")
def browser():
    with launch_browser() as b:
        yield b


@pytest.fixture
def page(browser, server):
    pg = open_console(browser, server.api_key)
    yield pg
    pg.context.close()


def _ask(pg, text: str) -> dict:
    """Send a chat message; wait for the answer; its text, meta line and how many times its text grew."""
    n = pg.locator(".msg.assistant").count()
    pg.fill("#prompt", text)
    pg.click("#send")
    answer = pg.locator(".msg.assistant").nth(n)
    # count the updates of the answer's text while it streams in
    pg.evaluate("""(i) => {
        const body = document.querySelectorAll('.msg.assistant')[i].querySelector('.body');
        window.__updates = 0;
        new MutationObserver(() => { window.__updates += 1; })
            .observe(body, {childList: true, characterData: true, subtree: true});
    }""", n)
    pg.wait_for_function("(i) => document.querySelectorAll('.msg.assistant')[i].dataset.done", arg=n)
    meta = answer.locator(".meta")
    return {"done": answer.get_attribute("data-done"), "text": answer.locator(".body").inner_text(),
            "meta": meta.inner_text(), "cached": meta.get_attribute("data-cached"),
            "updates": pg.evaluate("window.__updates")}


def test_console_in_a_browser(page, server):
    with server.client() as c:
        _flush(c)  # the chats below and the marker prompt are what the tree view then shows
    page.goto(server.url + "/")
    page.wait_for_function("document.getElementById('model-name').textContent.length > 0")
    assert page.inner_text("#model-name") == server.model

    page.fill("#max_tokens", "24")
    first = _ask(page, "Name three colors.")
    assert first["done"] == "1", first
    assert first["text"].strip() and first["updates"] >= 2, first  # streamed: the text grew more than once
    assert "prompt tokens" in first["meta"] and first["cached"] != "", first
    second = _ask(page, "And three animals.")
    assert second["done"] == "1" and int(second["cached"]) > 0, second  # the first turn is a cached prefix
    screenshot(page, "console-chat")

    page.click("#clear")
    page.select_option("#constraint-kind", "json_schema")
    page.fill("#constraint", json.dumps(SCHEMA))
    page.fill("#max_tokens", "64")
    answer = _ask(page, "Give the capital of France as JSON.")
    assert answer["done"] == "1", answer
    jsonschema.validate(json.loads(answer["text"]), SCHEMA)
    screenshot(page, "console-playground")

    page.select_option("#constraint-kind", "regex")
    page.fill("#constraint", "")
    page.fill("#prompt", "hello")
    page.click("#send")
    assert "empty" in page.inner_text("#constraint-error")  # a bad box is refused in the page, nothing sent

    with server.client() as c:
        word, prompt = _marker_prompt()  # the chats' prompts start with the chat template: no shared first token
        r = c.post("/generate", json={"text": prompt, "sampling_params": {"max_new_tokens": 1}})
        assert r.status_code == 200, r.text
    page.click("#tab-runtime")
    page.fill("#max-nodes", "500")  # the next poll asks for the largest snapshot
    node = page.locator(".tree .node", has_text=word).first
    node.wait_for()
    assert "tok" in node.text_content() and "hit" in node.text_content()
    assert page.locator(".pool-legend .num[data-state=cached]").inner_text().endswith("tok")
    page.wait_for_timeout(3500)  # two more polls: the charts have lines
    assert page.locator(".hit-chart polyline").count() == 1
    assert page.is_hidden("#runtime-error")
    screenshot(page, "console-runtime")
    assert not page.errors, page.errors
