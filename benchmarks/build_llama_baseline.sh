#!/usr/bin/env bash
# The llama.cpp baseline of bench_scale.py: llama-cpp-python 0.3.36 built from source into its own venvs (never
# into radixgen's), one per CPU build:
#   native: GGML_NATIVE=ON (every ISA extension of the build machine), AMX off (its AMX path crashed on the VMs
#           the figures come from; turn it on with AMX=ON where it works)
#   avx2:   AVX2 / FMA / F16C only, AVX-512 off: the class of CPU radixgen's RADIXGEN_CPU_ISA=x86-64-v3 build targets
# Usage: benchmarks/build_llama_baseline.sh [PREFIX] [native|avx2|all] [SOURCE]
#   PREFIX: where the venvs go (default /work/llama: PREFIX/native, PREFIX/avx2, as bench_scale.py's --llama-venv)
#   SOURCE: a pip requirement or sdist path (default: llama-cpp-python==0.3.36 from PyPI, built from source)
# Each build takes 15-30 minutes on 2 cores. Needs a C/C++ compiler, cmake and Python >= 3.9.
set -euo pipefail
PREFIX=${1:-/work/llama}
WHICH=${2:-all}
SOURCE=${3:-llama-cpp-python==0.3.36}
PYTHON=${PYTHON:-python3}
AMX=${AMX:-OFF}
COMMON="-DGGML_OPENMP=ON -DLLAMA_CURL=OFF"
declare -A ARGS=(
  [native]="-DGGML_NATIVE=ON -DGGML_AMX_TILE=$AMX -DGGML_AMX_INT8=$AMX -DGGML_AMX_BF16=$AMX $COMMON"
  [avx2]="-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_AVX512=OFF \
-DGGML_AVX512_VBMI=OFF -DGGML_AVX512_VNNI=OFF -DGGML_AVX512_BF16=OFF -DGGML_AVX_VNNI=OFF $COMMON"
)
builds=(native avx2)
[ "$WHICH" != all ] && builds=("$WHICH")
mkdir -p "$PREFIX"
for b in "${builds[@]}"; do
  [ -n "${ARGS[$b]:-}" ] || { echo "unknown build $b: native, avx2 or all" >&2; exit 2; }
  echo "building llama-cpp-python ($b) into $PREFIX/$b; log: $PREFIX/$b.log"
  "$PYTHON" -m venv "$PREFIX/$b"
  CMAKE_ARGS="${ARGS[$b]}" CMAKE_BUILD_PARALLEL_LEVEL=${CMAKE_BUILD_PARALLEL_LEVEL:-$(nproc)} \
    "$PREFIX/$b/bin/pip" install --no-cache-dir --no-binary llama-cpp-python -v "$SOURCE" > "$PREFIX/$b.log" 2>&1
  "$PREFIX/$b/bin/python" -c "import llama_cpp; print('$b: llama-cpp-python', llama_cpp.__version__)"
done
