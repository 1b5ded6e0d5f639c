import os
import sys

import torch

# tests import helpers (tiny_models) from this folder
sys.path.insert(0, os.path.dirname(__file__))

# Without a GPU the Triton kernels run under the Triton interpreter. TRITON_INTERPRET must be set before
# triton is first imported (triton decorates its own library functions then), and some test modules
# (SGLang's frontend, in tests/compat) import it during collection: so it is set here, first of all.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
