"""Running the `radixgen` command line as a subprocess, as a user would."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

# the installed console script (the entry point radixgen.cli:main); `python -m radixgen.cli` where it is absent
_SCRIPT = shutil.which("radixgen", path=os.path.dirname(sys.executable))
RADIXGEN = [_SCRIPT] if _SCRIPT else [sys.executable, "-m", "radixgen.cli"]


def cli(*args: str, env: dict[str, str] | None = None, input: str | None = None,  # noqa: A002
        timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([*RADIXGEN, *args], capture_output=True, text=True, input=input, timeout=timeout,
                          env={**os.environ, **(env or {})})
