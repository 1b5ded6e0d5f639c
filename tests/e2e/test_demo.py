"""`make demo` (examples/quickstart.py) prints right answers on every CPU: the demo runs as `make demo` runs it,
in a subprocess, once per kind of CPU emulated here, and each answer it prints is checked.

The kinds differ in bf16 rounding and in which kernels run: this CPU's C kernels at the dtype `auto` picks
here (bf16 on AMX), the C kernels of a CPU with AVX512-BF16 but no AMX (RADIXGEN_CPU_ISA=cooperlake, oneDNN
held below AMX: an AMD EPYC of the Zen 4 kind), those of an AVX2 CPU (x86-64-v3, bf16 weights in float32 math:
`auto` there),
and the plain torch path (RADIXGEN_DISABLE_CPU_KERNELS=1) in bf16 without AMX. A kind whose build needs what this
CPU lacks (AVX512-BF16 on an AVX2 CPU) is skipped: its kernels would die of SIGILL here."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from radixgen.kernels import _cpu_build

pytestmark = pytest.mark.slow

QUICKSTART = Path(__file__).resolve().parents[2] / "examples" / "quickstart.py"

CPUS = {
    "native-auto": ({}, "auto"),
    "avx512bf16-no-amx": ({"RADIXGEN_CPU_ISA": "cooperlake", "ONEDNN_MAX_CPU_ISA": "AVX512_CORE_BF16"}, "bfloat16"),
    "avx2-bfloat16": ({"RADIXGEN_CPU_ISA": "x86-64-v3", "ONEDNN_MAX_CPU_ISA": "AVX2", "ATEN_CPU_CAPABILITY": "avx2"},
                      "bfloat16"),
    "torch-bf16-no-amx": ({"RADIXGEN_DISABLE_CPU_KERNELS": "1", "ONEDNN_MAX_CPU_ISA": "AVX512_CORE_BF16"},
                          "bfloat16"),
}

# what each section must print (the JSON extraction as Python's repr of the record)
RECORDS = [
    ("Last summer we flew to Lisbon to visit my cousin.", {"city": "Lisbon", "country": "Portugal"}),
    ("My sister studies architecture in Paris.", {"city": "Paris", "country": "France"}),
    ("I grew up in Rio de Janeiro.", {"city": "Rio de Janeiro", "country": "Brazil"}),
]
SENTIMENTS = [
    ("The food was wonderful and the staff were friendly.", "positive"),
    ("Cold soup, rude waiter, never again.", "negative"),
]


def run_demo(env: dict[str, str], dtype: str) -> str:
    proc = subprocess.run([sys.executable, str(QUICKSTART), "--dtype", dtype], capture_output=True, text=True,
                          env={**os.environ, **env}, timeout=3600)  # a hang guard: on 2 busy cores a run took 30 min
    assert proc.returncode == 0, proc.stderr[-4000:]
    return proc.stdout


def answer_after(lines: list[str], prompt: str) -> str:
    """The line after `prompt`, which the demo prints as ` -> answer`."""
    i = lines.index(prompt)
    assert lines[i + 1].startswith(" -> "), lines[i : i + 2]
    return lines[i + 1][4:]


@pytest.mark.parametrize("cpu", list(CPUS))
def test_demo_prints_right_answers(cpu):
    env, dtype = CPUS[cpu]
    missing = _cpu_build.missing_flags(env.get("RADIXGEN_CPU_ISA", "native"))
    if missing:
        pytest.skip(f"this CPU lacks {missing} for the {env['RADIXGEN_CPU_ISA']} build")
    out = run_demo(env, dtype)
    lines = out.splitlines()
    assert "Traceback" not in out
    if dtype != "auto":
        assert f"== multi-turn chat ({dtype}" in out

    assistant = [ln.split(":", 1)[1] for ln in lines if ln.startswith("assistant:")]
    assert len(assistant) == 2, out
    assert "Paris" in assistant[0], assistant
    assert "Louvre" in assistant[1], assistant

    for sentence, record in RECORDS:
        assert answer_after(lines, sentence) == repr(record), out

    for review, label in SENTIMENTS:
        answer = answer_after(lines, review)
        assert answer.startswith(f"sentiment: {label}  scores:"), answer
    assert lines[-1].startswith("overall: ") and "of prompt tokens came from the radix cache" in lines[-1]
