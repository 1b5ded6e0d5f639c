import os
import sys

import torch

# tests import helpers (tiny_models) from this folder
sys.path.insert(0, os.path.dirname(__file__))

# SGLang's frontend (tests/compat, tests/server/test_native_compat.py) is installed by the Makefile into a
# `pip install --target` folder of its own, not into .venv's site-packages, whose pins its declared
# dependencies conflict with: it is importable in tests from here.
SGLANG_TARGET = os.path.join(sys.prefix, "extras-sglang")
if os.path.isdir(SGLANG_TARGET):
    sys.path.insert(0, SGLANG_TARGET)

# Without a GPU the Triton kernels run under the Triton interpreter. TRITON_INTERPRET must be set before
# triton is first imported (triton decorates its own library functions then), and some test modules
# (SGLang's frontend, in tests/compat) import it during collection: so it is set here, first of all.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
