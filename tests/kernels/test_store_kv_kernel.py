import pytest
import torch
from kernel_testutil import DEVICE

from radixgen.kernels import store_kv, store_kv_ref

T, HKV = 9, 2


def _inputs(gen, dtype, head_dim, slot_dtype=torch.int64):
    k_buffer = torch.randn(32, HKV, head_dim, generator=gen).to(dtype).to(DEVICE)
    v_buffer = torch.randn(32, HKV, head_dim, generator=gen).to(dtype).to(DEVICE)
    slots = (torch.randperm(31, generator=gen)[:T] + 1).to(slot_dtype).to(DEVICE)  # shuffled, never slot 0
    # k and v as the runtime produces them: strided views into one fused qkv projection
    qkv = torch.randn(T, 5 * HKV * head_dim, generator=gen).to(dtype).to(DEVICE)
    k = qkv[:, 3 * HKV * head_dim:4 * HKV * head_dim].view(T, HKV, head_dim)
    v = qkv[:, 4 * HKV * head_dim:].view(T, HKV, head_dim)
    return k_buffer, v_buffer, slots, k, v


@pytest.mark.parametrize("head_dim", [16, 64])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_store_kv_kernel_matches_ref(triton, gen, dtype, head_dim):
    slot_dtype = torch.int32 if head_dim == 16 else torch.int64
    k_buffer, v_buffer, slots, k, v = _inputs(gen, dtype, head_dim, slot_dtype)
    assert not k.is_contiguous()
    k_ref, v_ref = k_buffer.clone(), v_buffer.clone()
    store_kv(k_buffer, v_buffer, slots, k, v)
    store_kv_ref(k_ref, v_ref, slots, k, v)
    assert torch.equal(k_buffer, k_ref) and torch.equal(v_buffer, v_ref)  # a copy: bit-exact


def test_store_kv_ref_matches_naive_loop(gen):
    k_buffer, v_buffer, slots, k, v = _inputs(gen, torch.float32, 16)
    k_before = k_buffer.clone()
    k_naive, v_naive = k_buffer.clone(), v_buffer.clone()
    for i, slot in enumerate(slots.tolist()):
        k_naive[slot], v_naive[slot] = k[i], v[i]
    store_kv_ref(k_buffer, v_buffer, slots, k, v)
    assert torch.equal(k_buffer, k_naive) and torch.equal(v_buffer, v_naive)
    assert not torch.equal(k_buffer, k_before)


@pytest.mark.parametrize("fn", [store_kv, store_kv_ref])
def test_store_kv_rejects_bad_arguments(gen, fn):
    k_buffer, v_buffer, slots, k, v = _inputs(gen, torch.float32, 16)
    good = dict(k_buffer=k_buffer, v_buffer=v_buffer, slots=slots, k=k, v=v)
    cases = [
        (dict(k=k.to(torch.bfloat16), v=v.to(torch.bfloat16)), "pool dtype"),
        (dict(k=k[:, :1]), r"k must be \(T, 2, 16\)"),
        (dict(v=v[:-1]), "v shape"),
        (dict(slots=slots[:-1]), "slots has 8 entries"),
        (dict(slots=slots.float()), "slots dtype"),
        (dict(k_buffer=k_buffer.transpose(1, 2)), "k_buffer"),
        (dict(v_buffer=v_buffer[:-1]), "v_buffer"),
    ]
    for change, message in cases:
        with pytest.raises(ValueError, match=message):
            fn(**{**good, **change})
