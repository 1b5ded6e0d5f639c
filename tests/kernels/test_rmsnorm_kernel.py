import pytest
import torch
from kernel_testutil import DEVICE, TOL, rel_err

from radixgen.kernels import fused_add_rmsnorm, fused_add_rmsnorm_ref


def _inputs(gen, dtype, hidden, rows=5):
    x = torch.randn(rows, hidden, generator=gen).to(dtype).to(DEVICE)
    residual = torch.randn(rows, hidden, generator=gen).to(dtype).to(DEVICE)
    weight = (1 + 0.5 * torch.randn(hidden, generator=gen)).to(DEVICE)
    return x, residual, weight


@pytest.mark.parametrize("with_residual", [True, False])
@pytest.mark.parametrize("hidden", [64, 100, 5000])  # 5000 > the 4096 block: the row loop takes two sweeps
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rmsnorm_kernel_matches_ref(triton, poison, gen, dtype, hidden, with_residual):
    x, residual, weight = _inputs(gen, dtype, hidden)
    residual = residual if with_residual else None
    out, res_out = fused_add_rmsnorm(x, weight.to(dtype), 1e-5, residual)
    ref_out, ref_res = fused_add_rmsnorm_ref(x, weight.to(dtype), 1e-5, residual)
    assert out.dtype == dtype and res_out.dtype == dtype
    assert rel_err(out, ref_out) < TOL[dtype]
    assert rel_err(res_out, ref_res) < TOL[dtype]
    if not with_residual:
        assert res_out is x


def test_rmsnorm_kernel_fp32_weight_with_bf16_rows(triton, poison, gen):
    x, residual, weight = _inputs(gen, torch.bfloat16, 64)
    out, _ = fused_add_rmsnorm(x, weight, 1e-6, residual)
    assert rel_err(out, fused_add_rmsnorm_ref(x, weight, 1e-6, residual).out) < TOL[torch.bfloat16]


def test_rmsnorm_ref_matches_textbook_formula(gen):
    x, residual, weight = _inputs(gen, torch.float32, 100)
    h = x.double() + residual.double()
    expected = h / torch.sqrt((h * h).mean(-1, keepdim=True) + 1e-5) * weight.double()
    out, res_out = fused_add_rmsnorm_ref(x, weight, 1e-5, residual)
    assert rel_err(res_out, h) < 1e-6
    assert rel_err(out, expected) < 1e-5
    out_plain, _ = fused_add_rmsnorm_ref(x, weight, 1e-5)
    plain = x.double() / torch.sqrt((x.double() ** 2).mean(-1, keepdim=True) + 1e-5) * weight.double()
    assert rel_err(out_plain, plain) < 1e-5


@pytest.mark.parametrize("fn", [fused_add_rmsnorm, fused_add_rmsnorm_ref])
def test_rmsnorm_rejects_bad_arguments(gen, fn):
    x, residual, weight = _inputs(gen, torch.float32, 64)
    good = dict(x=x, weight=weight, eps=1e-6, residual=residual)
    cases = [
        (dict(x=x[0]), "x must be 2-D"),
        (dict(weight=weight[:-1]), "weight has 63 entries"),
        (dict(residual=residual[:-1]), "residual"),
        (dict(residual=residual.to(torch.bfloat16)), "residual dtype"),
        (dict(x=x.int()), "x dtype"),
        (dict(x=x.t().contiguous().t()), "unit stride"),
        (dict(eps=-1.0), "eps"),
    ]
    for change, message in cases:
        with pytest.raises(ValueError, match=message):
            fn(**{**good, **change})
