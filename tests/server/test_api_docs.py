"""The copy-paste client examples of docs/api-anthropic.md, docs/api-ollama.md and docs/api-kserve.md, run as
written against the adapters' shared server (its URL, key and model name put in place of the documented
localhost:30000, sk-local and SmolLM2-135M-Instruct)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from server_proc import APIS_KEYS

DOCS = Path(__file__).resolve().parents[2] / "docs"


def example(page: str) -> str:
    blocks = re.findall(r"```python\n(.*?)```", (DOCS / page).read_text(), re.S)
    assert blocks, f"{page} has no python example"
    return blocks[0]


@pytest.mark.parametrize("page", ["api-anthropic.md", "api-ollama.md", "api-kserve.md"])
def test_the_documented_example_runs(apis_server, page, capsys):
    code = example(page)
    assert "localhost:30000" in code and "sk-local" in code
    host = apis_server.url.removeprefix("http://")
    code = (code.replace("localhost:30000", host).replace("sk-local", APIS_KEYS[0])
            .replace("SmolLM2-135M-Instruct", apis_server.model))
    exec(compile(code, page, "exec"), {"__name__": "docs_example"})
    printed = capsys.readouterr().out
    assert printed.strip(), f"{page}'s example printed nothing"
