"""Building csrc/cpu_kernels.c with the system C compiler, for this CPU or for a named instruction set.

`native` (-march=native) is what the runtime loads. The others are CPUs unlike this one, for which the tests
build and check a variant too: `x86-64-v3` (AVX2, FMA) and `skylake-avx512` (AVX512F, no BF16) lack
AVX512-BF16; `cooperlake` has it but not AVX512-VBMI2 (the int4 matmul's other path) nor AMX.
Builds are cached under ~/.cache/radixgen/kernels (RADIXGEN_KERNEL_CACHE overrides), keyed by the sources,
the compiler, the flags and, for native, the CPU.
"""

from __future__ import annotations

import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

SRC_DIR = Path(__file__).parent / "csrc"
SOURCES = ("cpu_kernels.c", "cpu_kernels_impl.h", "cpu_pool_impl.h", "cpu_kv_quant.h", "cpu_lora.h",
           "cpu_parallel.h", "cpu_linear.h", "cpu_moe.h", "cpu_moe_step.h", "cpu_bitmask.h",
           "cpu_linear_avx2.h", "cpu_linear_amx.h", "cpu_profile.h", "cpu_kv_copy.h", "cpu_linear_layout.h",
           "cpu_linear_bf16_avx2.h", "cpu_linear_avx512.h", "cpu_linear_avx512_gemm.h",
           "cpu_gguf_k.h", "cpu_gguf_more.h",
           "cpu_gguf_q.h", "cpu_task_pool.h", "cpu_linear_f32_fixed.h")
ISAS = {"native": "-march=native", "x86-64-v3": "-march=x86-64-v3", "skylake-avx512": "-march=skylake-avx512",
        "cooperlake": "-march=cooperlake"}
_FLAGS = ("-O3", "-fopenmp", "-fno-math-errno", "-fno-trapping-math")
# the CPU flags (/proc/cpuinfo's names) each build needs to run: a build for more than the CPU has dies of SIGILL
NEEDS = {"native": frozenset(), "x86-64-v3": frozenset({"avx2", "fma", "bmi2"}),
         "skylake-avx512": frozenset({"avx512f", "avx512bw", "avx512vl"}),
         "cooperlake": frozenset({"avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx512_bf16"})}


def compiler() -> str:
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        raise RuntimeError("no C compiler found (cc/gcc); set CC")
    return cc


def _cpuinfo(key: str) -> str:
    """The first /proc/cpuinfo line starting with `key` ("" where there is none)."""
    try:
        return next(ln for ln in Path("/proc/cpuinfo").read_text().splitlines() if ln.startswith(key))
    except (OSError, StopIteration):
        return ""


def cpu_vendor() -> str:
    """This CPU's vendor_id ("GenuineIntel", "AuthenticAMD", ...), "" where /proc/cpuinfo does not say."""
    return _cpuinfo("vendor_id").partition(":")[2].strip()


def cpu_model() -> str:
    """This CPU's model name ("" where /proc/cpuinfo does not say)."""
    return _cpuinfo("model name").partition(":")[2].strip()


def cpu_flags() -> frozenset[str]:
    """This CPU's flags as /proc/cpuinfo lists them (empty where it does not say)."""
    return frozenset(_cpuinfo("flags").partition(":")[2].split())


def missing_flags(isa: str) -> list[str]:
    """The CPU flags build `isa` needs that this CPU lacks (none: it can run here)."""
    if isa not in ISAS:
        raise ValueError(f"unknown instruction set {isa!r}; known: {sorted(ISAS)}")
    return sorted(NEEDS[isa] - cpu_flags())


def flags(isa: str) -> tuple[str, ...]:
    """The compiler's flags for `isa`. The native build of an AMD CPU streams matmul weights with NTA prefetches
    (RG_STREAM_NTA), every other build with T0 ones: see GEMV_HINT in csrc/cpu_linear.h."""
    if isa not in ISAS:
        raise ValueError(f"unknown instruction set {isa!r}; known: {sorted(ISAS)}")
    nta = ("-DRG_STREAM_NTA",) if isa == "native" and cpu_vendor() == "AuthenticAMD" else ()
    return (*_FLAGS, ISAS[isa], *nta)


def cache_dir() -> Path:
    return Path(os.environ.get("RADIXGEN_KERNEL_CACHE") or Path.home() / ".cache" / "radixgen" / "kernels")


def _build_key(cc: str, isa: str) -> str:
    h = hashlib.sha256()
    for name in SOURCES:
        h.update((SRC_DIR / name).read_bytes())
    h.update(" ".join((cc, *flags(isa))).encode())
    h.update(platform.machine().encode())
    if isa == "native":  # -march=native: a different CPU needs a different build
        h.update(_cpuinfo("flags").encode())
    return h.hexdigest()[:16]


def _run(cmd: list[str]) -> str | None:
    """The compiler's complaint, or None when it succeeded."""
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True)
    except OSError as exc:
        return str(exc)
    return proc.stderr[-2000:] if proc.returncode != 0 else None


def library_path(isa: str = "native", out_dir: Path | None = None) -> Path:
    """Where the build for `isa` with this compiler and these sources is (or will be) cached."""
    return (out_dir or cache_dir()) / f"cpu_kernels-{isa}-{_build_key(compiler(), isa)}.so"


def build(isa: str = "native", out_dir: Path | None = None) -> Path:
    """The shared library for `isa`, compiled unless the cache (or out_dir) already holds it."""
    out = library_path(isa, out_dir)
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    # build into a temporary name and rename: concurrent builders (test workers, server processes) never
    # load a half-written library
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=out.parent)
    os.close(fd)
    cmd = [compiler(), *flags(isa), "-shared", "-fPIC", "-o", tmp, str(SRC_DIR / "cpu_kernels.c")]
    error = _run(cmd)
    if error is not None:
        os.unlink(tmp)
        raise RuntimeError(f"building the CPU kernels failed ({' '.join(cmd)}):\n{error}")
    os.replace(tmp, out)
    return out


def preprocess(isa: str) -> str:
    """cpu_kernels.c after the preprocessor with `isa`'s flags, only the lines that come from csrc's own files
    (the prototypes a build of that instruction set exports, stubs included)."""
    cmd = [compiler(), *flags(isa), "-E", str(SRC_DIR / "cpu_kernels.c")]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"preprocessing failed ({' '.join(cmd)}):\n{proc.stderr[-2000:]}")
    keep, ours = [], False
    for line in proc.stdout.splitlines():
        if line.startswith("# "):  # a line marker: `# <line> "<file>" <flags>`
            parts = line.split('"')
            ours = len(parts) > 1 and Path(parts[1]).name in SOURCES
            continue
        if ours:
            keep.append(line)
    return "\n".join(keep)
