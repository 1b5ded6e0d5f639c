"""The web console's page and scripts (static files in console/, shipped as package data; no build step), served
at `/` by the server (runtime/server/console_api.py, which adds the JSON it polls) and by the router (router/app.py,
over every worker)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from starlette.responses import FileResponse, Response

from radixgen.common.http_errors import APIError

CONSOLE_DIR = Path(__file__).parent / "console"
CONSOLE_FILES = {"app.js": "text/javascript", "style.css": "text/css", "tree.js": "text/javascript",
                 "charts.js": "text/javascript"}


async def console_index() -> Response:
    return FileResponse(CONSOLE_DIR / "index.html", media_type="text/html")


async def console_file(name: str) -> Response:
    if name not in CONSOLE_FILES:  # a fixed list: no path ever reaches the file system from the URL
        raise APIError(404, f"no console file {name!r}", None, "not_found")
    return FileResponse(CONSOLE_DIR / name, media_type=CONSOLE_FILES[name])


def add_console_static(target: Any) -> None:
    """The page and its files on an app or router (also the router's: radixgen.router.app)."""
    target.add_api_route("/", console_index, methods=["GET"], include_in_schema=False)
    target.add_api_route("/console/{name}", console_file, methods=["GET"], include_in_schema=False)
