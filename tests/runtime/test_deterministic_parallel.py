"""The deterministic mode across parallel layouts, on a tiny random Llama in bf16: the probes' output ids and
logprobs (determinism_helpers.group_workload: cached prefixes of several lengths, then the probes beside random
other requests of other lengths) are the same bits with tp 2 (spawned ranks over gloo, one thread each: the
row-parallel sums in tp 2's fixed segments, layers/fixed_order.py; prefill on the layer-by-layer path, decode on
the fused C step) and with pp 2 as in one process. (The sizes it does not run are refused: test_deterministic.py.)"""

from __future__ import annotations

import pytest
import torch
from determinism_helpers import group_workload, mismatches
from parallel_helpers import run_group
from tiny_models import tiny_model_dir

from radixgen.kernels import cpu
from radixgen.runtime.config import RuntimeConfig
from radixgen.runtime.executor.model_runner import ModelRunner

KL = cpu.lib() if cpu.available() else None
pytestmark = pytest.mark.skipif(KL is None or not KL.has_decode_step,
                                reason="the deterministic mode needs the AVX512-BF16 build of the CPU kernels")
CONFIG = dict(dtype="bfloat16", deterministic=True)


@pytest.fixture(scope="module")
def model_path() -> str:
    return str(tiny_model_dir("llama"))


@pytest.fixture(scope="module")
def reference(model_path):
    """tp 1, pp 1, in this process (as run_group configures its ranks)."""
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        runner = ModelRunner(RuntimeConfig(model=model_path, max_total_tokens=2048, max_running_requests=8,
                                           **CONFIG))
        assert runner.fused_decode is not None
        return group_workload(runner)
    finally:
        torch.set_num_threads(old)


@pytest.mark.parametrize("layout", [{"tp_size": 2}, {"pp_size": 2},
                                    pytest.param({"tp_size": 2, "pp_size": 2}, marks=pytest.mark.slow)])
def test_probes_keep_their_bits_across_layouts(model_path, reference, layout):
    got = run_group(model_path, workload="determinism", **CONFIG, **layout)
    assert got["fused"]
    assert mismatches(got["logits"], reference) == []


@pytest.mark.slow
def test_tp4_keeps_its_own_bits(model_path):
    """tp 4 (four spawned ranks) sums its own cut (each rank's share one segment, added in rank order:
    layers/fixed_order.py): a probe alone and, later, from the cache beside other requests gives the same bits at
    that size (tp 1 == tp 2 is the cross-layout equality, above; the sums' mechanics at tp 3 and 4 in one process:
    tests/kernels/test_deterministic_kernels.py)."""
    res = run_group(model_path, workload="determinism_alone", tp_size=4, **CONFIG)
    batched, alone = res["logits"]
    assert alone and mismatches(batched, alone) == []
