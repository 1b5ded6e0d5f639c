"""Before vs after, in one run: the same benchmarks on two revisions of radixgen, taking turns.

    .venv/bin/python benchmarks/compare_revisions.py BASE            # BASE (a commit) against the working tree
    .venv/bin/python benchmarks/compare_revisions.py BASE --rounds 2 --bench bench_forward.py --quick

Each revision runs its own benchmark scripts on its own code: BASE is checked out with `git worktree` into a
temporary folder, and a folder of links named `radixgen` (its python/, with its kernels/ as radixgen.kernels)
goes first on PYTHONPATH, ahead of the editable install (whose finder comes after the path), for the benchmark
and every process it starts. The two revisions alternate bench by bench, so a slow spell of this shared machine
falls on both; compare figures only within one run.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_BENCHES = ("bench_forward.py --quick", "bench_prefix_cache.py --quick", "bench_constrained.py")
# lines of a benchmark's output worth setting side by side: those with a rate or a speed-up
FIGURE = re.compile(r"tok/s|req/s|\d\.\d+x|hit", re.I)


def package_root(tree: Path, into: Path) -> Path:
    """A folder holding `radixgen`: links to the tree's python/ entries (and, in a revision from before the kernels
    moved into python/, kernels -> the tree's kernels/)."""
    pkg = into / "radixgen"
    pkg.mkdir(parents=True)
    for entry in (tree / "python").iterdir():
        if entry.name != "__pycache__":
            (pkg / entry.name).symlink_to(entry)
    if (tree / "kernels").is_dir():
        (pkg / "kernels").symlink_to(tree / "kernels")
    return into


def run_bench(tree: Path, path_root: Path | None, bench: str) -> tuple[str, float]:
    script, *args = bench.split()
    env = dict(os.environ)
    if path_root is not None:
        # an older revision may look for the default model's package on the path only: the Makefile's --target
        # folder goes there too
        model = Path(sys.prefix) / "extras-model"
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(path_root), str(model) if model.is_dir() else None,
                                                          env.get("PYTHONPATH")]))
    t0 = time.perf_counter()
    p = subprocess.run([sys.executable, str(tree / "benchmarks" / script), *args], cwd=tree, env=env,
                       capture_output=True, text=True)
    took = time.perf_counter() - t0
    out = p.stdout + (f"\n[exit {p.returncode}]\n{p.stderr[-2000:]}" if p.returncode else "")
    return out, took


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("base", help="the revision to compare against (a commit, a branch)")
    ap.add_argument("--bench", action="append", help="a benchmark script and its flags (repeatable); default: "
                    + "; ".join(DEFAULT_BENCHES))
    ap.add_argument("--rounds", type=int, default=1, help="turns of each revision per benchmark")
    args = ap.parse_args()
    benches = args.bench or list(DEFAULT_BENCHES)
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                          text=True).stdout.strip()
    with tempfile.TemporaryDirectory(prefix="radixgen-base-") as tmp:
        base_tree = Path(tmp) / "tree"
        subprocess.run(["git", "worktree", "add", "--detach", "-q", str(base_tree), args.base], cwd=ROOT, check=True)
        try:
            base_root = package_root(base_tree, Path(tmp) / "path")
            sides = ((f"before ({args.base})", base_tree, base_root), (f"after ({head} + working tree)", ROOT, None))
            for bench in benches:
                for r in range(args.rounds):
                    for name, tree, root in sides:
                        out, took = run_bench(tree, root, bench)
                        print(f"\n===== {bench} | {name} | round {r + 1} | {took:.0f} s", flush=True)
                        print(out.rstrip())
                        figures = [line for line in out.splitlines() if FIGURE.search(line)]
                        print(f"----- figures ({name}):\n" + "\n".join(figures[-40:]), flush=True)
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", str(base_tree)], cwd=ROOT)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
