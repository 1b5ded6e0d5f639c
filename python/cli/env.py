"""`radixgen env`: what this machine and build can do, for a bug report: the CPU's features, the C kernel build
in use and why (or why not), the versions of what radixgen runs on, the GPU if any."""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
from importlib import metadata
from typing import Any

DESCRIPTION = __doc__.removeprefix("`radixgen env`: ").replace("\n", " ")

# /proc/cpuinfo's names of the features the kernels choose by
CPU_FEATURES = ("avx2", "fma", "avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx512_bf16", "avx512_vbmi2",
                "amx_tile", "amx_bf16", "amx_int8")
PACKAGES = ("radixgen", "torch", "transformers", "tokenizers", "xgrammar", "gguf", "safetensors", "numpy", "triton",
            "fastapi", "uvicorn", "pyzmq", "llama_cpp_python")


def add_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="print JSON")
    parser.add_argument("--build", action="store_true", help="build the C kernels now if they are not built yet "
                        "(otherwise they are built on first use)")


def _version(name: str) -> str | None:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def cpu_report() -> dict[str, Any]:
    from radixgen.kernels import _cpu_build

    flags = _cpu_build.cpu_flags()
    return {"model": _cpu_build.cpu_model() or platform.processor(), "vendor": _cpu_build.cpu_vendor(),
            "machine": platform.machine(), "cores": os.cpu_count(),
            "features": {f: f in flags for f in CPU_FEATURES}}


def kernels_report(build: bool) -> dict[str, Any]:
    """The build the runtime would load (RADIXGEN_CPU_ISA or native), whether it is built, and why not."""
    from radixgen.kernels import _cpu_build

    isa = os.environ.get("RADIXGEN_CPU_ISA") or "native"
    out: dict[str, Any] = {"isa": isa, "in_use": False}
    if os.environ.get("RADIXGEN_DISABLE_CPU_KERNELS", "") not in ("", "0"):
        return {**out, "why": "disabled by RADIXGEN_DISABLE_CPU_KERNELS: the torch path runs"}
    try:
        missing = _cpu_build.missing_flags(isa)
        out["compiler"] = _cpu_build.compiler()
        out["flags"] = " ".join(_cpu_build.flags(isa))
        path = _cpu_build.library_path(isa)
    except (ValueError, RuntimeError) as e:
        return {**out, "why": f"{e}: the torch path runs"}
    if missing:
        return {**out, "why": f"this CPU lacks {', '.join(missing)} for the {isa} build: the torch path runs"}
    out["library"] = str(path)
    if not path.exists() and not build:
        return {**out, "why": "not built yet: compiled on first use (`radixgen env --build` builds it now)"}
    from radixgen.kernels import cpu

    try:
        lib = cpu.load(isa)
    except (RuntimeError, OSError) as e:
        return {**out, "why": f"the build failed, the torch path runs: {str(e)[:500]}"}
    why = ("-march=native: built for this CPU" if isa == "native" else f"RADIXGEN_CPU_ISA={isa}")
    if "-DRG_STREAM_NTA" in out["flags"]:
        why += "; matmul weights streamed with non-temporal prefetches (an AMD CPU)"
    return {**out, "in_use": True, "why": why, "amx": lib.has_amx, "fused_decode_step": lib.has_decode_step}


def gpu_report() -> dict[str, Any]:
    import torch

    out: dict[str, Any] = {"cuda_available": torch.cuda.is_available(), "cuda": torch.version.cuda,
                           "hip": getattr(torch.version, "hip", None), "devices": []}
    if torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            p = torch.cuda.get_device_properties(i)
            out["devices"].append({"name": p.name, "capability": f"{p.major}.{p.minor}",
                                   "memory_gb": round(p.total_memory / 2**30, 1)})
    return out


def report(build: bool) -> dict[str, Any]:
    import torch

    from radixgen.runtime.loader import ModelLoadError, cache_root, default_gguf_path

    try:
        default_model = str(default_gguf_path())
    except ModelLoadError as e:
        default_model = f"missing ({e})"
    return {
        "python": sys.version.split()[0], "platform": platform.platform(),
        "cpu": cpu_report(),
        "torch": {"cpu_capability": torch.backends.cpu.get_cpu_capability(), "threads": torch.get_num_threads()},
        "kernels": kernels_report(build),
        "gpu": gpu_report(),
        "versions": {p: _version(p) for p in PACKAGES},
        "default_model": default_model, "model_cache": str(cache_root()),
        "environment": {k: v for k, v in os.environ.items() if k.startswith(("RADIXGEN_", "OMP_", "CUDA_VISIBLE"))},
    }


def run(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    rep = report(args.build)
    if args.json:
        print(json.dumps(rep, indent=2))
        return 0
    cpu, k, gpu = rep["cpu"], rep["kernels"], rep["gpu"]
    print(f"python          {rep['python']} on {rep['platform']}")
    print(f"cpu             {cpu['model']} ({cpu['vendor']}, {cpu['machine']}, {cpu['cores']} cores)")
    print("cpu features    " + "  ".join(f"{f} {'yes' if v else 'no'}" for f, v in cpu["features"].items()))
    print(f"torch cpu       {rep['torch']['cpu_capability']}, {rep['torch']['threads']} threads")
    print(f"kernels         {k['isa']} build {'in use' if k['in_use'] else 'not in use'}: {k['why']}")
    for key in ("compiler", "flags", "library", "amx", "fused_decode_step"):
        if key in k:
            print(f"  {key.replace('_', ' '):18} {k[key]}")
    if gpu["devices"]:
        for d in gpu["devices"]:
            print(f"gpu             {d['name']} (compute {d['capability']}, {d['memory_gb']} GB), CUDA {gpu['cuda']}")
    else:
        print(f"gpu             none (torch built with CUDA {gpu['cuda']})" if gpu["cuda"] else "gpu             none")
    print("versions        " + ", ".join(f"{p} {v}" for p, v in rep["versions"].items() if v))
    print(f"default model   {rep['default_model']}")
    print(f"model cache     {rep['model_cache']}")
    for key, value in rep["environment"].items():
        print(f"  {key}={value}")
    return 0
