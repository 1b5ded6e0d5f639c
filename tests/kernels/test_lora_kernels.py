"""The segmented LoRA kernels against their torch references on fresh random inputs: Triton's shrink and expand
(under the interpreter without a GPU) and the C kernel of the CPU path; their argument checks; and the Triton
wiring of a ModelRunner with LoRA adapters (as on CUDA) against PEFT."""

from __future__ import annotations

import pytest
import torch
from kernel_testutil import DEVICE, TOL, lora_case, rel_err
from kv_helpers import kv_of
from lora_helpers import base_model, make_adapter
from tiny_models import tiny_model_dir

from radixgen.kernels import cpu, cpu_lora, lora_expand_, lora_expand_ref_, lora_shrink, lora_shrink_ref
from radixgen.kernels.lora import expand_weights, pack_kpairs, unpack_kpairs
from radixgen.runtime.config import RuntimeConfig
from radixgen.runtime.executor.model_runner import ForwardInput, ModelRunner
from radixgen.runtime.layers.ops import TritonOps
from radixgen.runtime.lora import load_lora_adapter


def on_device(case):
    return case._replace(**{f: getattr(case, f).to(DEVICE) for f in case._fields if isinstance(getattr(case, f),
                                                                                               torch.Tensor)})


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_shrink_and_expand_match_refs(triton, poison, gen, dtype):
    c = on_device(lora_case(gen, dtype))
    seg = (c.rows, c.seg_starts, c.seg_lens, c.seg_slots, c.max_len)
    h, h_ref = lora_shrink(c.x, c.a, *seg), lora_shrink_ref(c.x, c.a, *seg)
    assert h.dtype == dtype and rel_err(h, h_ref) < TOL[dtype]
    in_no_segment = torch.ones(c.x.shape[0], dtype=torch.bool, device=DEVICE)
    in_no_segment[c.rows] = False
    assert (h[in_no_segment] == 0).all()  # base-model rows are left alone
    r = 2 * c.b.shape[2]
    y, y_ref = c.y.clone(), c.y.clone()
    for g, (c0, c1) in enumerate(c.segments):
        lora_expand_(y, h_ref, c.b, c.scales, *seg, c0, c1, g * r)
        lora_expand_ref_(y_ref, h_ref, c.b, c.scales, *seg, c0, c1, g * r)
    assert rel_err(y - c.y, y_ref - c.y) < TOL[dtype]
    assert torch.equal(y[in_no_segment], c.y[in_no_segment])


def test_kpair_blocks_round_trip(gen):
    m = torch.randn(37, 24, generator=gen)
    t = pack_kpairs(m)
    assert t.shape == (3, 12, 16, 2) and torch.equal(t[1, 5, 3], m[19, 10:12])
    assert torch.equal(unpack_kpairs(t)[:37], m) and (unpack_kpairs(t)[37:] == 0).all()


def test_refs_are_the_textbook_formula(gen):
    """Each listed row gets (x @ A_s^T)[segment] @ B_s * scale_s with its own slot's weights."""
    c = lora_case(gen, torch.float32)
    y = c.reference()
    r = 2 * c.b.shape[2]
    for start, n, slot in zip(c.seg_starts.tolist(), c.seg_lens.tolist(), c.seg_slots.tolist(), strict=True):
        for row in c.rows[start:start + n].tolist():
            h = c.x[row].double() @ unpack_kpairs(c.a[slot]).double().t()
            for g, (c0, c1) in enumerate(c.segments):
                bt = expand_weights(c.b, slot, c0, c1).double()
                want = c.y[row, c0:c1].double() + h[g * r:(g + 1) * r] @ bt * float(c.scales[slot])
                assert rel_err(y[row, c0:c1], want) < 1e-5


@pytest.mark.skipif(not (cpu.available() and cpu.lib().has_decode_step), reason="needs AVX512-BF16 C kernels")
@pytest.mark.parametrize("t", [2, 9, 70])  # rows through the expand in blocks of 8, 4 and 1
def test_c_kernel_matches_refs(gen, t):
    c = lora_case(gen, torch.bfloat16, t=t)
    y = c.y.clone()
    cpu_lora.lora_delta_(*c.args(y))
    assert rel_err(y.float() - c.y.float(), c.reference().float() - c.y.float()) < TOL[torch.bfloat16]


@pytest.mark.skipif(not cpu.available(), reason="no C kernels")
def test_c_kernel_checks_its_arguments(gen):
    c = lora_case(gen, torch.bfloat16)
    cases = [
        (dict(y=c.y.float()), "y dtype"),
        (dict(b=c.b.reshape(4, 6, 8, -1)), "b must be 5-D"),
        (dict(a=c.a[:, :2].contiguous()), "expected a"),
        (dict(segments=[(0, 40), (41, 63), (63, 86)]), "segments must tile"),
        (dict(ranks=torch.tensor([16, 6, 0, 18], dtype=torch.int32)), "ranks must lie"),
        (dict(x=c.x.t().contiguous().t()), "x must be contiguous"),
    ]
    names = ("y", "x", "a", "b", "scales", "ranks", "segments", "rows", "seg_starts", "seg_lens", "seg_slots")
    for change, match in cases:
        args = dict(zip(names, c.args(c.y.clone()), strict=True))
        with pytest.raises(ValueError, match=match):
            cpu_lora.lora_delta_(**{**args, **change})


@pytest.mark.parametrize("fn", [lora_expand_, lora_expand_ref_])
def test_expand_checks_its_arguments(gen, fn):
    c = lora_case(gen, torch.float32)
    h = torch.zeros(c.x.shape[0], 48)
    good = (c.y, h, c.b, c.scales, c.rows, c.seg_starts, c.seg_lens, c.seg_slots, c.max_len)
    with pytest.raises(ValueError, match=r"ranks \[40, 56\) must lie in h's 48"):
        fn(*good, 0, 40, 40)
    with pytest.raises(ValueError, match="columns"):
        fn(*good, 0, 90, 0)
    with pytest.raises(ValueError, match="one entry per segment"):
        fn(c.y, h, c.b, c.scales, c.rows, c.seg_starts[:-1], c.seg_lens, c.seg_slots, c.max_len, 0, 40, 0)


def test_triton_wired_runner_with_adapters_matches_peft(triton, tmp_path):
    """A ModelRunner on the Triton ops (as on CUDA: dense weights, the Triton LoRA kernels) with a mixed batch of
    two adapters and the base model, prefill and decode, against the PEFT models."""
    models = {n: make_adapter("llama", tmp_path / n, rank=r, seed=s) for n, r, s in (("a", 4, 1), ("b", 8, 2))}
    cfg = RuntimeConfig(model=str(tiny_model_dir("llama")), dtype="float32", max_total_tokens=512,
                        max_running_requests=4, enable_lora=True, max_loras=2, max_lora_rank=8)
    runner = ModelRunner(cfg, ops=TritonOps())
    assert runner.model.layers[0].self_attn.qkv_proj.method.name.endswith("+lora")
    for slot, name in enumerate(("b", "a")):
        runner.lora_pool.write(slot, runner.lora_pool.stage(load_lora_adapter(name, tmp_path / name)))
    prompts, uses, slot_of = [[5, 6, 7, 8, 9], [10, 11, 12], [13, 14, 15, 16]], ["a", None, "b"], [1, -1, 0]
    kv = kv_of(runner)
    rows, lens = [kv.table.allocate() for _ in prompts], [len(p) for p in prompts]
    slots = [kv.allocator.allocate(n) for n in lens]
    for row, s in zip(rows, slots, strict=True):
        kv.table.write(row, 0, s)
    ids = torch.tensor([t for p in prompts for t in p])
    pos = torch.cat([torch.arange(n) for n in lens])
    last = torch.tensor(lens).cumsum(0) - 1
    got = [runner.forward(ForwardInput(ids, pos, torch.cat(slots), torch.tensor(rows), [0] * 3, lens, last,
                                      lora_slots=slot_of))]
    s = kv.allocator.allocate(3)
    for i, row in enumerate(rows):
        kv.table.write(row, lens[i], s[i:i + 1])
    nxt = [50, 51, 52]
    got.append(runner.forward(ForwardInput(torch.tensor(nxt), torch.tensor(lens), s, torch.tensor(rows), lens,
                                           [1] * 3, torch.arange(3), lora_slots=slot_of)))
    base = base_model("llama")
    for i, (p, use) in enumerate(zip(prompts, uses, strict=True)):
        with torch.no_grad():
            want = (base if use is None else models[use])(torch.tensor([p + [nxt[i]]])).logits[0]
        assert rel_err(got[0][i], want[len(p) - 1]) < 1e-4 and rel_err(got[1][i], want[len(p)]) < 1e-4, i
