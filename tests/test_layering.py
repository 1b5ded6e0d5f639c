"""The layering docs/architecture.md states ("Layering"), checked: import-linter's contracts (pyproject.toml,
[tool.importlinter]), the kernels' independence, and the size of a module."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MAX_LINES = 400
# a module that must be longer says why in its docstring, with these words
LONGER_BECAUSE = "Longer than 400 lines:"


def test_import_contracts_hold():
    p = subprocess.run([sys.executable, "-c", "from importlinter.cli import lint_imports_command as c; c()"],
                       cwd=ROOT, capture_output=True, text=True, timeout=300)
    summary = [line for line in p.stdout.splitlines() if line.startswith("Contracts:")]
    assert p.returncode == 0, p.stdout[-6000:] + p.stderr[-2000:]
    assert summary and "0 broken" in summary[-1], p.stdout[-6000:]


def _radixgen_imports(path: Path) -> list[str]:
    names = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.append(node.module)
    return [n for n in names if n == "radixgen" or n.startswith("radixgen.")]


def test_kernels_import_nothing_of_radixgen_but_themselves():
    bad = {str(p.relative_to(ROOT)): names for p in (ROOT / "python" / "kernels").rglob("*.py")
           if (names := [n for n in _radixgen_imports(p) if not n.startswith("radixgen.kernels")])}
    assert not bad, f"kernels reach into the rest of radixgen: {bad}"


def test_the_kernels_do_not_shadow_hugging_faces_kernels_package():
    # `python -m ...` from the checkout's root puts the root first on sys.path: radixgen.kernels in a root folder
    # named kernels/ (as it was) hid the installed `kernels` package, which transformers imports at start
    code = "import importlib.util as u; s = u.find_spec('kernels'); print(s and s.origin)"
    p = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert p.returncode == 0 and not (ROOT / "kernels" / "__init__.py").exists(), p.stderr
    origin = p.stdout.strip()
    assert origin == "None" or "site-packages" in origin or not Path(origin).resolve().is_relative_to(ROOT), origin


def test_no_module_is_longer_than_400_lines_without_saying_why():
    long = []
    for folder in ("python",):
        for p in (ROOT / folder).rglob("*.py"):
            text = p.read_text()
            lines = text.count("\n")
            if lines > MAX_LINES and LONGER_BECAUSE not in (ast.get_docstring(ast.parse(text)) or ""):
                long.append(f"{p.relative_to(ROOT)}: {lines} lines")
    assert not long, "modules over 400 lines (split them, or say why at the top): " + "; ".join(long)
