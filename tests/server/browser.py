"""A real headless browser for the web console tests: Python playwright (its bundled driver) driving Debian's
Chromium (/usr/bin/chromium; playwright's own browser download does not work here). `make test` installs both."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]
SCREENSHOTS = Path(__file__).resolve().parents[2] / "build" / "screenshots"
TIMEOUT_MS = 180_000  # a CPU answer on a machine shared with other test runs


def launch_browser():
    """A context manager yielding a launched Chromium; skips without playwright, fails without Chromium."""
    sync_api = pytest.importorskip("playwright.sync_api", reason="playwright is in the test extra")
    if not os.path.exists(CHROMIUM):
        pytest.fail(f"{CHROMIUM} is missing: `make test` installs Debian's chromium (apt-get install -y chromium)")

    class Launched:
        def __enter__(self):
            self._p = sync_api.sync_playwright().start()
            self.browser = self._p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
            return self.browser

        def __exit__(self, *exc):
            self.browser.close()
            self._p.stop()

    return Launched()


def open_console(browser, api_key: str | None):
    """A new page (in its own context, with the API key stored as the console keeps it); `page.errors` collects
    console errors and uncaught exceptions. Close it with page.context.close()."""
    context = browser.new_context(viewport={"width": 1400, "height": 900})
    if api_key:
        context.add_init_script(f"localStorage.setItem('radixgen-api-key', {json.dumps(api_key)})")
    page = context.new_page()
    page.set_default_timeout(TIMEOUT_MS)
    page.errors = []
    page.on("console", lambda m: page.errors.append(m.text) if m.type == "error" else None)
    page.on("pageerror", lambda e: page.errors.append(str(e)))
    return page


def screenshot(page, name: str) -> Path:
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    path = SCREENSHOTS / f"{name}.png"
    page.screenshot(path=str(path), full_page=True)
    print(f"screenshot: {path}")
    return path
