"""docs/models.md's table lists every architecture of the registry (runtime/architectures.py), and nothing else."""

from __future__ import annotations

import re
from pathlib import Path

from radixgen.runtime.architectures import ARCHITECTURES


def test_every_registered_architecture_has_its_row():
    doc = (Path(__file__).parents[2] / "docs" / "models.md").read_text()
    table = doc.split("## What works for each architecture", 1)[1].split("\n\n", 2)[1]
    rows = [line for line in table.splitlines() if line.startswith("| ") and not line.startswith("| ---")][1:]
    names = [re.match(r"\| (\w+)", r).group(1) for r in rows]
    assert sorted(names) == sorted(ARCHITECTURES)
    files = {re.match(r"\| \w+.*? \| (\w+)\.py \|", r).group(1) for r in rows}
    assert files == {module for _, module, _ in ARCHITECTURES.values()}
    assert all(r.count(" | ") == 8 for r in rows), "every row fills the nine columns"
