"""benchmarks/report.py: a report from given figures is a Markdown file whose images are real PNGs of the
size drawn, an index of the folder's reports, and clear errors for figures that do not add up."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest

pytest.importorskip("matplotlib", reason="matplotlib is in the test and bench extras")
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

from report import Report  # noqa: E402

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _png_size(path: Path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == PNG_MAGIC, path
    return int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big")  # the IHDR chunk


def test_report_writes_markdown_and_pngs(tmp_path):
    r = Report(tmp_path, "bench_demo", "A demo report")
    r.text("Two workloads, measured in this run.")
    bars = r.bars("speedup", "Speed-up", ["few-shot", "multi-turn"], {"cache on": [3.5, 1.8], "hf": [0.4, 0.3]},
                  ylabel="x vs cache off", baseline=1.0)
    lines = r.lines("decode", "Decode", [1, 8, 32], {"ours": [20.0, 120.0, 300.0], "roofline": [40, 300, math.nan]},
                    xlabel="batch", ylabel="tok/s", log_x=True, dashed=["roofline"])
    r.table(["workload", "speed-up"], [["few-shot", "3.50x"], ["multi-turn", "1.80x"]])
    path = r.write()
    md = path.read_text()
    assert path == tmp_path / "bench_demo.md" and md.startswith("# A demo report\n")
    assert md.index("Two workloads") < md.index("![Speed-up](bench_demo-speedup.png)") < md.index(
        "![Decode](bench_demo-decode.png)") < md.index("| few-shot | 3.50x |")
    assert bars == tmp_path / "bench_demo-speedup.png" and lines == tmp_path / "bench_demo-decode.png"
    for png in (bars, lines):
        w, h = _png_size(png)
        assert (w, h) == (round(7.5 * 110), round(4.0 * 110)), png  # figsize x DPI
    assert "[A demo report](bench_demo.md)" in (tmp_path / "index.md").read_text()

    Report(tmp_path, "bench_other", "Another").write()  # a second benchmark in the same folder: both listed
    index = (tmp_path / "index.md").read_text()
    assert "(bench_demo.md)" in index and "[Another](bench_other.md)" in index and "index.md" not in index


def test_report_refuses_figures_that_do_not_add_up(tmp_path):
    r = Report(tmp_path, "bench_bad", "Bad")
    with pytest.raises(ValueError, match="'cache on' has 1 values for 2 categories"):
        r.bars("x", "x", ["a", "b"], {"cache on": [1.0]}, ylabel="x")
    with pytest.raises(ValueError, match="has 2 values for 3 x values"):
        r.lines("y", "y", [1, 2, 3], {"s": [1, 2]}, xlabel="b", ylabel="t")
    with pytest.raises(ValueError, match="every row needs 2 cells"):
        r.table(["a", "b"], [["1"]])
    with pytest.raises(ValueError, match="file name stem"):
        Report(tmp_path, "../escape", "x")
    assert not list(tmp_path.glob("*.png"))
