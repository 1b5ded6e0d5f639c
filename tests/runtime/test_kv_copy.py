"""KV copy orders in the step: the record on the wire, its application to a pool (model dtype and 8-bit), and a
device-to-device copy given through the KV cache manager reaching every rank of a tp 2 group (gloo, spawned
processes) before the step's forward: a row reading the copied slots gives the logits of the row reading the
originals, in one process and over tp 2, and without the order it does not."""

from __future__ import annotations

import pytest
import torch
from parallel_helpers import drive_copy, run_group
from tiny_models import tiny_model_dir

from radixgen.runtime.config import RuntimeConfig
from radixgen.runtime.executor.model_runner import ModelRunner
from radixgen.runtime.executor.step_messages import (
    CopyDirection,
    ForwardInput,
    KVCopies,
    KVCopyQueue,
    StepDescription,
    StepKind,
)
from radixgen.runtime.ground.kv_pool import KVPool, TableWriteLog


def test_copy_orders_travel_in_the_step_description():
    fi = ForwardInput(torch.tensor([5, 6]), torch.tensor([0, 1]), torch.tensor([11, 12]), torch.tensor([0]), [0],
                      [2], torch.tensor([1]))
    queue = KVCopyQueue()
    queue.copy_slots(torch.tensor([3, 4, 5]), torch.tensor([20, 21, 22]))
    queue.copy_slots(torch.tensor([9]), torch.tensor([30]))
    desc = StepDescription(StepKind.FORWARD, fi, TableWriteLog().take(), queue.take())
    assert not len(queue) and not queue.take()
    header, payload = desc.pack()
    assert payload.numel() == StepDescription.payload_len(header)
    back = StepDescription.unpack(header, payload)
    for a, b in zip(back.kv_copies, desc.kv_copies, strict=True):
        assert torch.equal(a, b)
    assert back.kv_copies.lengths.tolist() == [3, 1] and back.kv_copies.dst.tolist() == [20, 21, 22, 30]
    empty = StepDescription.unpack(*StepDescription(StepKind.FORWARD, fi, TableWriteLog().take()).pack())
    assert not empty.kv_copies and empty.forward_input.extend_lens == [2]
    with pytest.raises(ValueError, match="same length"):
        queue.copy_slots(torch.tensor([1, 2]), torch.tensor([3]))


@pytest.mark.parametrize("code_dtype", [None, torch.int8])
def test_copies_apply_to_every_layer_and_scale_in_order(code_dtype):
    pool = KVPool(2, 16, 2, 4, torch.float32, code_dtype=code_dtype)
    bufs = pool.k_buffers + pool.v_buffers + (pool.k_scales or []) + (pool.v_scales or [])
    for i, buf in enumerate(bufs):
        buf.copy_((torch.randn(buf.shape) * 50).to(buf.dtype) + i)
    before = [b.clone() for b in bufs]
    queue = KVCopyQueue()
    queue.copy_slots(torch.tensor([1, 2, 3]), torch.tensor([2, 3, 4]))  # overlapping: reads the old rows
    queue.copy_slots(torch.tensor([4]), torch.tensor([9]))  # reads what the first order wrote
    queue.take().apply(pool)
    for buf, old in zip(bufs, before, strict=True):
        assert torch.equal(buf[[2, 3, 4]], old[[1, 2, 3]]) and torch.equal(buf[9], old[3])
        keep = [s for s in range(16) if s not in (2, 3, 4, 9)]
        assert torch.equal(buf[keep], old[keep])
    bad = KVCopies(torch.tensor([5]), torch.tensor([1]), torch.tensor([1]), torch.tensor([2]))
    with pytest.raises(ValueError, match="direction 5 is not implemented"):
        bad.apply(pool)
    assert CopyDirection.DEVICE_TO_DEVICE == 0


def test_a_copy_order_is_applied_before_the_next_forward_in_one_process():
    path = str(tiny_model_dir("llama"))
    torch.set_num_threads(1)
    cfg = RuntimeConfig(model=path, dtype="float32", max_total_tokens=256, max_running_requests=4)
    copied = drive_copy(ModelRunner(cfg, path))
    assert torch.allclose(copied[0], copied[1], atol=1e-5, rtol=0)
    missing = drive_copy(ModelRunner(cfg, path), copy=False)
    assert not torch.allclose(missing[0], missing[1], atol=1e-3, rtol=0)
    torch.testing.assert_close(missing[0], copied[0])


def test_a_copy_order_reaches_every_rank_of_a_tp2_group():
    """Rank 1 holds half the KV heads: had it not copied its part, row 1 would read zeros there."""
    got = run_group(str(tiny_model_dir("llama")), dtype="float32", tp_size=2, workload="drive_copy")["logits"]
    assert got.shape[0] == 2
    assert torch.allclose(got[0], got[1], atol=1e-5, rtol=0)
