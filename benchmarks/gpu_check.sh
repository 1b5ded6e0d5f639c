#!/usr/bin/env bash
# radixgen GPU check, for a GPU machine with python3, torch, triton and transformers but no internet and
# none of our other dependencies. From the repository root (or anywhere):
#   benchmarks/gpu_check.sh               kernel tests on CUDA, kernel timings vs SDPA, engine decode tokens/s,
#                                         and tensor parallelism (tp 2 / tp 4) where the machine has that many GPUs
#   benchmarks/gpu_check.sh --cpu-smoke   the same paths on tiny shapes on the CPU (Triton interpreted)
#   benchmarks/gpu_check.sh --deterministic-only   the deterministic mode's kernel tests and part alone
# Other wheels are taken from .whl/ at the repository root when that folder exists. PYTHON picks the interpreter.
# Finishes in under 8 minutes; the last thing printed is one table.
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
PY=${PYTHON:-python3}
BUDGET_S=470
SMOKE=0
DET_ONLY=0
for arg in "$@"; do
    [ "$arg" = "--cpu-smoke" ] && SMOKE=1
    [ "$arg" = "--deterministic-only" ] && DET_ONLY=1
done

# 1. the wheels of our other dependencies, without an index and without resolving (torch etc. are there)
if compgen -G "$ROOT/.whl/*.whl" >/dev/null; then
    rm -rf /tmp/site
    "$PY" -m pip install -q --no-index --no-deps --target /tmp/site "$ROOT"/.whl/*.whl || exit 1
    export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi

# 2. `import radixgen` without installing the project: a package folder of links to python/'s entries,
#    plus kernels/ as radixgen.kernels (what pyproject's package-dir mapping does for an install)
SITE=/tmp/rgsite
rm -rf "$SITE"
mkdir -p "$SITE/radixgen"
for entry in "$ROOT"/python/*; do
    ln -s "$entry" "$SITE/radixgen/$(basename "$entry")"
done
ln -s "$ROOT/kernels" "$SITE/radixgen/kernels"
export PYTHONPATH=$SITE${PYTHONPATH:+:$PYTHONPATH}
"$PY" -c "import radixgen.kernels" || { echo "radixgen.kernels does not import" >&2; exit 1; }

# 3. the kernel tests, natively on CUDA (their conftest picks the interpreter only when there is no GPU);
#    the smoke run takes one small file, the full suite already runs on the CPU in CI
TESTS=(tests/kernels)
[ "$SMOKE" = 1 ] && TESTS=(tests/kernels/test_store_kv_kernel.py)
[ "$DET_ONLY" = 1 ] && TESTS=(tests/kernels/test_deterministic_triton.py)
if "$PY" -c "import pytest" 2>/dev/null; then
    LOG=$(mktemp)
    timeout 240 "$PY" -m pytest -q -p no:cacheprovider "${TESTS[@]}" 2>&1 | tee "$LOG"
    TEST_STATUS=$(grep -E "(passed|failed|error)" "$LOG" | tail -n 1)
    rm -f "$LOG"
else
    TEST_STATUS="skipped: pytest is not importable (put its wheels in .whl/)"
fi

# 4 + 5. kernel timings against SDPA, measured ceilings, engine decode throughput; prints the final table
LEFT=$((BUDGET_S - SECONDS))
[ "$LEFT" -lt 90 ] && LEFT=90
# the script stops its running part at the deadline and still prints its table; timeout is the backstop
timeout "$LEFT" "$PY" benchmarks/gpu_check.py "$@" --kernel-tests "${TEST_STATUS:-no result}" \
    --deadline-s $((LEFT - 25))
STATUS=$?
echo "gpu_check.sh: ${SECONDS}s, exit ${STATUS}"
exit "$STATUS"
