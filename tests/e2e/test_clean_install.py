"""The install that `make test` set up is consistent: `pip check` on the interpreter running the tests (.venv's)
finds no package whose declared requirements are missing or of other versions. The two packages whose
declarations conflict with ours (SGLang's frontend, the default model's package) are installed by the
Makefile into `pip install --target` folders outside site-packages for that reason."""

from __future__ import annotations

import subprocess
import sys


def test_pip_check_passes():
    proc = subprocess.run([sys.executable, "-m", "pip", "check"], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"pip check on {sys.prefix} failed:\n{proc.stdout}{proc.stderr}"
