"""What a user installs: the wheel, not the editable tree.

A wheel once shipped without a package that the scheduler imports (the package list was written by hand). This
builds the wheel from the checkout, installs it into a fresh virtual environment (no index; the test
environment's site-packages visible behind it for the dependencies), imports every module of the installed copy
and runs one greedy request on the default model from it, which must give the editable tree's tokens; its console
script runs `radixgen env` and `radixgen models list`.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PROMPT = "The capital of France is"

# Run inside the fresh environment: import every module, then one greedy request.
CHECK = r"""
import importlib, json, pkgutil, sys
import radixgen
mods, failed = [], {}
for info in pkgutil.walk_packages(radixgen.__path__, "radixgen."):
    if info.name.endswith("__main__"):
        continue  # running a module's __main__ starts a process; importing its package is what counts
    try:
        importlib.import_module(info.name)
        mods.append(info.name)
    except Exception as e:
        failed[info.name] = repr(e)
from radixgen import Engine
with Engine(max_total_tokens=4096) as eng:
    out = eng.generate(sys.argv[1], {"max_new_tokens": 8, "temperature": 0})
print(json.dumps({"file": radixgen.__file__, "modules": mods, "failed": failed, "ids": out["output_ids"]}))
"""


def _run(cmd: list[str], **kw) -> subprocess.CompletedProcess:
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=600, **kw)
    assert p.returncode == 0, f"{' '.join(map(str, cmd))} failed:\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}"
    return p


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    # --no-build-isolation: the build uses this environment's setuptools instead of fetching one
    _run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(out), str(ROOT)])
    (whl,) = out.glob("radixgen-*.whl")
    return whl


def _source_modules() -> set[str]:
    """Every module of the checkout, by import name (python/ is radixgen)."""
    names = set()
    for folder, pkg in ((ROOT / "python", "radixgen"),):
        for f in folder.rglob("*.py"):
            parts = f.relative_to(folder).with_suffix("").parts
            if "__pycache__" in parts:
                continue
            names.add(".".join((pkg, *parts)).removesuffix(".__init__"))
    return names


def test_wheel_holds_every_module_and_the_kernel_sources(wheel):
    with zipfile.ZipFile(wheel) as z:
        files = set(z.namelist())
    shipped = {n.removesuffix(".py").replace("/", ".").removesuffix(".__init__") for n in files if n.endswith(".py")}
    missing = _source_modules() - shipped
    assert not missing, f"the wheel lacks {sorted(missing)}"
    csrc = sorted(p.name for p in (ROOT / "python" / "kernels" / "csrc").iterdir() if p.suffix in (".c", ".h"))
    assert csrc and all(f"radixgen/kernels/csrc/{name}" in files for name in csrc)


@pytest.mark.slow
def test_installed_wheel_imports_every_module_and_serves_a_greedy_request(wheel, tmp_path):
    venv = tmp_path / "venv"
    _run([sys.executable, "-m", "venv", "--without-pip", str(venv)])
    py = venv / "bin" / "python"
    site = Path(_run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"]).stdout.strip())
    # The dependencies come from the test environment, behind the fresh one's own site-packages. A path listed in
    # a .pth file is not scanned for .pth files itself, so the editable install's finder does not come along.
    deps = [p for p in sys.path if p.endswith("site-packages")]  # this environment's (and any it layers over)
    # the Makefile's --target folder of the default model's package (radixgen.runtime.loader finds it on the path)
    deps += [str(p) for p in [Path(sys.prefix) / "extras-model"] if p.is_dir()]
    (site / "_test_env.pth").write_text("".join(f"{p}\n" for p in deps))
    _run([sys.executable, "-m", "pip", "--python", str(py), "install", "-q", "--no-index", "--no-deps",
          "--force-reinstall", str(wheel)])
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    p = _run([str(py), "-c", CHECK, PROMPT], cwd=tmp_path, env=env)
    got = json.loads(p.stdout.strip().splitlines()[-1])
    assert Path(got["file"]).is_relative_to(site), f"imported {got['file']}, not the installed copy"
    assert not got["failed"], f"modules that fail to import from the wheel: {got['failed']}"
    assert {"radixgen.runtime.scheduler.speculative.stage", "radixgen.runtime.scheduler.core"} <= set(got["modules"])
    # the console script the wheel installs, and two of its commands that need no model
    radixgen = venv / "bin" / "radixgen"
    assert "models" in _run([str(radixgen), "--help"], cwd=tmp_path, env=env).stdout
    report = json.loads(_run([str(radixgen), "env", "--json"], cwd=tmp_path, env=env).stdout)
    assert report["versions"]["radixgen"] and report["kernels"]["why"]
    cache = json.loads(_run([str(radixgen), "models", "list", "--json"], cwd=tmp_path, env=env).stdout)
    assert isinstance(cache["entries"], list)

    from radixgen import Engine

    with Engine(max_total_tokens=4096) as eng:
        ref = eng.generate(PROMPT, {"max_new_tokens": 8, "temperature": 0})
    assert got["ids"] == ref["output_ids"]
    # the commands that run a model, from the installed script: one prompt, and a program file
    engine_flags = ["--max-total-tokens", "4096", "--max-new-tokens", "8", "--temperature", "0"]
    done = json.loads(_run([str(radixgen), "complete", PROMPT, "--json", *engine_flags], cwd=tmp_path,
                           env=env).stdout.strip().splitlines()[-1])
    assert done["text"] == ref["text"]
    program = tmp_path / "program.py"
    program.write_text("import radixgen as rg\n\n\n@rg.function\ndef answer(s, prompt):\n"
                       "    s += prompt + rg.gen('out')\n")
    ran = json.loads(_run([str(radixgen), "run", str(program), "--arg", f"prompt={PROMPT}", "--json",
                           *engine_flags], cwd=tmp_path, env=env).stdout.strip().splitlines()[-1])
    assert ran["error"] is None and ran["variables"]["out"] == ref["text"]
    latency = tmp_path / "latency.json"
    _run([str(radixgen), "bench", "latency", "--input-len", "16", "--output-len", "4", "--batch-sizes", "1",
          "--iters", "1", "--max-total-tokens", "4096", "--output", str(latency)], cwd=tmp_path, env=env)
    assert json.loads(latency.read_text())["results"][0]["decode_tok_s"] > 0
    pexpect = pytest.importorskip("pexpect")  # the chat in a pseudo-terminal: one turn, then Ctrl-D
    child = pexpect.spawn(str(radixgen), ["chat", "--temperature", "0", "--max-tokens", "4", "--max-total-tokens",
                                          "4096"], encoding="utf-8", timeout=240, cwd=str(tmp_path),
                          env={**env, "TERM": "dumb"})
    try:
        child.expect(">>> ")
        child.sendline(PROMPT)
        child.expect(r"\[(\d+) tokens, [0-9.]+ tok/s")
        assert int(child.match.group(1)) == 4
        child.expect(">>> ")
        child.sendeof()
        child.expect(pexpect.EOF)
    finally:
        child.close(force=True)


def test_the_dockerfiles_copy_what_the_build_reads():
    # `pip install .` in deploy/Dockerfile.*: the build reads pyproject.toml, setup.py (package discovery) and the
    # README (the long description); a file left out builds a wheel without packages, or no wheel
    needed = {"pyproject.toml", "setup.py", "README.md", "python"}
    for name in ("Dockerfile.cpu", "Dockerfile.cuda"):
        copied = set()
        for line in (ROOT / "deploy" / name).read_text().splitlines():
            if line.startswith("COPY "):
                copied.update(p.rstrip("/").removeprefix("./") for p in line.split()[1:-1])
        assert needed <= copied, f"{name} does not copy {sorted(needed - copied)}"
