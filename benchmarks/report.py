"""Benchmark reports as pictures: a Markdown file with PNG plots, written by each `benchmarks/bench_*.py --report DIR`.

    report = Report(args.report, "bench_prefix_cache", "Prefix cache speed-up by workload")
    report.text("What was measured ...")
    report.bars("speedup", "Speed-up vs cache off", ["few-shot", "multi-turn"], {"cache on": [4.1, 2.3]},
                ylabel="x", baseline=1.0)
    report.table(["workload", "req/s"], [["few-shot", "12.1"]])
    report.write()      # DIR/bench_prefix_cache.md, DIR/bench_prefix_cache-speedup.png, and DIR/index.md

Several benchmarks may write into one folder (`make bench`): each has its own Markdown file and figures (named
after it), and `index.md` lists every report found there. matplotlib is imported only when a report is written
(the `bench` extra; the benchmarks run without it when no --report is given), with the Agg backend: no display.
"""

from __future__ import annotations

import argparse
import datetime
import platform
from collections.abc import Sequence
from pathlib import Path

import torch

PALETTE = ["#2f6fde", "#2a9d6a", "#d08a1c", "#8e5bd0", "#c8423b", "#5b6b7d"]
DPI = 110


def add_report_arg(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--report", metavar="DIR", default=None,
                    help="also write a Markdown report with PNG plots into DIR (needs matplotlib: the bench extra)")


def _pyplot():
    try:
        import matplotlib
    except ImportError as e:  # the bench extra: pip install -e '.[bench]'
        raise RuntimeError("--report needs matplotlib (pip install -e '.[bench]'; `make bench` installs it)") from e
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


class Report:
    """One benchmark's report: Markdown blocks and figures, in the order added, written by `write`."""

    def __init__(self, directory: str | Path, name: str, title: str) -> None:
        if not name.replace("_", "").replace("-", "").isalnum():
            raise ValueError(f"a report name is a file name stem (letters, digits, - and _), got {name!r}")
        self.dir = Path(directory)
        self.name = name
        self.title = title
        self.blocks: list[str] = []
        self.figures: list[Path] = []
        self._plt = _pyplot()  # fail now, before the benchmark runs, when matplotlib is missing

    # ------------------------------------------------------------------ text

    def text(self, markdown: str) -> None:
        self.blocks.append(markdown.strip())

    def table(self, headers: Sequence[str], rows: Sequence[Sequence[object]]) -> None:
        if any(len(r) != len(headers) for r in rows):
            raise ValueError(f"every row needs {len(headers)} cells")
        lines = ["| " + " | ".join(map(str, headers)) + " |", "|" + " --- |" * len(headers)]
        lines += ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]
        self.blocks.append("\n".join(lines))

    # ------------------------------------------------------------------ figures

    def bars(self, name: str, title: str, categories: Sequence[str], series: dict[str, Sequence[float]],
             ylabel: str, baseline: float | None = None, value_format: str = "{:.2f}") -> Path:
        """Grouped bars: one group per category, one bar per series (each a value per category); `baseline`
        draws a dashed reference line (e.g. 1.0 for a speed-up)."""
        for label, values in series.items():
            if len(values) != len(categories):
                raise ValueError(f"series {label!r} has {len(values)} values for {len(categories)} categories")
        plt = self._plt
        fig, ax = plt.subplots(figsize=(7.5, 4.0))
        width = 0.8 / max(1, len(series))
        for i, (label, values) in enumerate(series.items()):
            xs = [j + (i - (len(series) - 1) / 2) * width for j in range(len(categories))]
            bars = ax.bar(xs, values, width * 0.92, label=label, color=PALETTE[i % len(PALETTE)])
            ax.bar_label(bars, labels=[value_format.format(v) for v in values], fontsize=8, padding=2)
        if baseline is not None:
            ax.axhline(baseline, color="#5b6b7d", linestyle="--", linewidth=1)
        ax.set_xticks(range(len(categories)), categories)
        ax.set_ylabel(ylabel)
        ax.margins(y=0.15)
        ax.legend(frameon=False)  # also for one series: its label may say what the title does not (the batch)
        return self._save(fig, ax, name, title)

    def lines(self, name: str, title: str, x: Sequence[float], series: dict[str, Sequence[float]], xlabel: str,
              ylabel: str, log_x: bool = False, log_y: bool = False, dashed: Sequence[str] = ()) -> Path:
        """One line per series over `x` (NaN values are gaps); series named in `dashed` (a ceiling, a
        roofline) are drawn dashed."""
        for label, values in series.items():
            if len(values) != len(x):
                raise ValueError(f"series {label!r} has {len(values)} values for {len(x)} x values")
        plt = self._plt
        fig, ax = plt.subplots(figsize=(7.5, 4.0))
        for i, (label, values) in enumerate(series.items()):
            ax.plot(x, values, label=label, color=PALETTE[i % len(PALETTE)], marker="o", markersize=4,
                    linestyle="--" if label in dashed else "-")
        if log_x:
            ax.set_xscale("log", base=2)
            ax.set_xticks(list(x), [f"{v:g}" for v in x])
        if log_y:
            ax.set_yscale("log")
        ax.set_xlabel(xlabel)
        ax.set_ylabel(ylabel)
        ax.legend(frameon=False)
        return self._save(fig, ax, name, title)

    def _save(self, fig, ax, name: str, title: str) -> Path:
        ax.set_title(title, fontsize=11)
        ax.grid(axis="y", color="#e3e6ea", linewidth=0.8)
        ax.set_axisbelow(True)
        for side in ("top", "right"):
            ax.spines[side].set_visible(False)
        fig.tight_layout()
        self.dir.mkdir(parents=True, exist_ok=True)
        path = self.dir / f"{self.name}-{name}.png"
        fig.savefig(path, dpi=DPI)
        self._plt.close(fig)
        self.figures.append(path)
        self.blocks.append(f"![{title}]({path.name})")
        return path

    # ------------------------------------------------------------------ output

    def write(self) -> Path:
        """DIR/<name>.md (and DIR/index.md listing every report in DIR); returns the report's path."""
        self.dir.mkdir(parents=True, exist_ok=True)
        when = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
        machine = (f"{platform.machine()}, {torch.get_num_threads()} torch threads, torch {torch.__version__}"
                   + (f", {torch.cuda.get_device_name()}" if torch.cuda.is_available() else ""))
        head = f"# {self.title}\n\n`{self.name}`, {when}; {machine}."
        path = self.dir / f"{self.name}.md"
        path.write_text("\n\n".join([head, *self.blocks]) + "\n")
        reports = sorted(p for p in self.dir.glob("*.md") if p.name != "index.md")
        index = ["# Benchmark reports", ""] + [f"- [{_title_of(p)}]({p.name})" for p in reports]
        (self.dir / "index.md").write_text("\n".join(index) + "\n")
        print(f"report: {path}")
        return path


def _title_of(path: Path) -> str:
    first = path.read_text().split("\n", 1)[0]
    return first[2:] if first.startswith("# ") else path.stem
