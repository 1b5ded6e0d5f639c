"""The Triton fused mixture-of-experts forward (radixgen.kernels.fused_moe) against its torch reference: float32,
bf16 and fp16, a decode-sized and a prefill-sized batch, every token on one expert, experts with no token, an
expert-parallel shard; the device-side sort of places by expert; the wrapper's checks."""

from __future__ import annotations

import pytest
import torch
from kernel_testutil import DEVICE, TOL, rel_err

from radixgen.kernels import fused_moe, fused_moe_ref
from radixgen.kernels.fused_moe import sort_places

E, H, IW = 6, 64, 48  # IW (expert width): no whole column tile


def case(t, k, dtype, gen, how="random"):
    x = torch.randn(t, H, generator=gen).to(dtype)
    gate_up = (torch.randn(E, 2 * IW, H, generator=gen) * 0.2).to(dtype)
    down = (torch.randn(E, H, IW, generator=gen) * 0.2).to(dtype)
    ids = torch.stack([torch.randperm(E, generator=gen)[:k] for _ in range(t)]).to(torch.int32)
    if how == "one_expert_takes_all":
        ids[:, 0] = 2
        ids[:, 1] = torch.where(ids[:, 1] == 2, 4, ids[:, 1])
    elif how == "idle_experts":
        ids = torch.tensor([[1, 5]] * t, dtype=torch.int32)
    w = torch.rand(t, k, generator=gen)
    w = w / w.sum(-1, keepdim=True)
    return [v.to(DEVICE) for v in (x, gate_up, down, w, ids)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize(("t", "how"), [(1, "random"), (5, "random"), (21, "one_expert_takes_all"),
                                        (9, "idle_experts")])
def test_fused_moe_matches_reference(triton, gen, dtype, t, how):
    args = case(t, 2, dtype, gen, how)
    got = fused_moe(*args)
    assert got.dtype == dtype and got.shape == (t, H)
    assert rel_err(got, fused_moe_ref(*args)) < TOL[dtype]


def test_fused_moe_expert_parallel_shard(triton, gen):
    x, gate_up, down, w, ids = case(7, 2, torch.float32, gen)
    whole = fused_moe(x, gate_up, down, w, ids)
    a = fused_moe(x, gate_up[:4].contiguous(), down[:4].contiguous(), w, ids, first_expert=0)
    b = fused_moe(x, gate_up[4:].contiguous(), down[4:].contiguous(), w, ids, first_expert=4)
    assert rel_err(a, fused_moe_ref(x, gate_up[:4], down[:4], w, ids, 0)) < TOL[torch.float32]
    assert rel_err(a + b, whole) < TOL[torch.float32]


def test_sort_places_groups_by_expert_in_whole_blocks():
    ids = torch.tensor([[3, 0], [0, 3], [1, 0], [7, 3]], dtype=torch.int32)  # 7: another rank's (EP)
    places, block_expert = sort_places(ids, 4, 0, 4)
    # expert 0: places 1, 2, 5; expert 1: 4; expert 3: 0, 3, 7; one block of 4 each; place 6 (expert 7) nowhere
    assert places[:12].tolist() == [1, 2, 5, -1, 4, -1, -1, -1, 0, 3, 7, -1]
    assert block_expert[:3].tolist() == [0, 1, 3] and (block_expert[3:] == -1).all()
    assert (places[12:] == -1).all()


def test_fused_moe_checks_its_arguments():
    x, gate_up, down, w, ids = case(3, 2, torch.float32, torch.Generator().manual_seed(0))
    with pytest.raises(ValueError, match="down must be"):
        fused_moe(x, gate_up, down[:, :, :8].contiguous(), w, ids)
    with pytest.raises(ValueError, match="topk_ids dtype"):
        fused_moe(x, gate_up, down, w, ids.long())
    with pytest.raises(ValueError, match="gate_up dtype"):
        fused_moe(x, gate_up.half(), down, w, ids)
