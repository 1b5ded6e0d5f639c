"""bf16 weights with float32 math on CPUs without AVX512-BF16 (csrc/cpu_linear_bf16_avx2.h): the builds for such
CPUs (x86-64-v3 = AVX2, skylake-avx512 = AVX512F without BF16), each where this CPU runs it, against torch's float32
matmul on the bf16-rounded weights, on shapes with ragged edges (output sizes no multiple of a 16-row block, input
sizes no multiple of anything but 2), through both kernels (streamed up to 4 rows, the panel GEMM beyond); and the
promise the deterministic mode relies on: a row's bits do not depend on how many rows share the call, which
rows they are, or the thread count."""

from __future__ import annotations

import shutil

import pytest
import torch
import torch.nn.functional as F

from radixgen.kernels import _cpu_build, cpu, cpu_linear
from radixgen.runtime import config
from radixgen.runtime.layers.quantization import unquantized
from radixgen.runtime.layers.quantization.base import CpuPackedLinear

pytestmark = pytest.mark.skipif(shutil.which("cc") is None and shutil.which("gcc") is None, reason="no C compiler")

ROWS = (1, 2, 3, 4, 5, 6, 7, 8, 9, 17, 65)  # the gemv's row tiles and tails, the GEMM's six-row tile and tails
SHAPES = ((37, 22), (100, 70), (129, 1538), (16, 2))  # (N, K)


@pytest.fixture(scope="module", params=["x86-64-v3", "skylake-avx512"])
def kl(request) -> cpu.CKernels:
    missing = _cpu_build.missing_flags(request.param)
    if missing:
        pytest.skip(f"this CPU lacks {missing} for {request.param}")
    return cpu.load(request.param)


def _case(gen: torch.Generator, n: int, k: int, m: int, dtype: torch.dtype):
    w = torch.randn(n, k, generator=gen)
    x = torch.randn(m, k, generator=gen).to(dtype)
    bias = torch.randn(n, generator=gen).to(dtype)
    return cpu_linear.pack_bf16(w), w.to(torch.bfloat16).float(), x, bias


def test_the_builds_without_avx512_bf16_multiply_bf16_fast(kl):
    assert kl.has_fast_bf16_linear and not kl.has_decode_step
    pw = cpu_linear.pack_bf16(torch.randn(40, 64))
    for dtype in (torch.float32, torch.bfloat16):  # no rows (an empty tensor may have no data pointer)
        assert cpu_linear.linear(pw, torch.empty(0, 64, dtype=dtype), float_out=True, kl=kl).shape == (0, 40)


@pytest.mark.parametrize(("n", "k"), SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_matches_float32_matmul_on_the_rounded_weights(kl, n, k, dtype, gen):
    for m in ROWS:
        pw, wr, x, bias = _case(gen, n, k, m, dtype)
        ref = F.linear(x.float(), wr) + bias.float()  # float32 math on the bf16 weights
        # float32 sums in another order: within a few float32 ulps of the sum of magnitudes
        tol = 4 * k * torch.finfo(torch.float32).eps * (F.linear(x.float().abs(), wr.abs()) + bias.float().abs())
        for float_out in (False, True):
            y = cpu_linear.linear(pw, x, bias, float_out=float_out, kl=kl)
            assert y.dtype == (torch.float32 if float_out else dtype) and y.shape == (m, n)
            if dtype == torch.float32:
                assert ((y - ref).abs() <= tol).all(), (m, (y - ref).abs().max())
            else:  # rounded to bf16 once: within half a bf16 ulp of the float32 result (plus its tolerance)
                assert ((y.float() - ref).abs() <= tol + ref.abs() * 2**-8).all(), (m, (y.float() - ref).abs().max())
        y = cpu_linear.linear(pw, x, kl=kl)  # no bias
        assert ((y.float() - F.linear(x.float(), wr)).abs() <= tol + y.float().abs() * 2**-8).all()


@pytest.mark.parametrize(("n", "k"), SHAPES[:3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_rows_bits_do_not_depend_on_the_batch(kl, n, k, dtype, gen):
    pw, _, x, bias = _case(gen, n, k, max(ROWS), dtype)
    alone = torch.cat([cpu_linear.linear(pw, x[i:i + 1], bias, kl=kl) for i in range(len(x))])
    for m in ROWS:  # the first m rows together, then the last m rows together (other tiles, other neighbours)
        assert torch.equal(cpu_linear.linear(pw, x[:m], bias, kl=kl), alone[:m]), m
        assert torch.equal(cpu_linear.linear(pw, x[-m:], bias, kl=kl), alone[-m:]), m
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one_thread = cpu_linear.linear(pw, x, bias, kl=kl)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one_thread, alone)


def test_bf16_layers_take_the_k_pair_layout_on_these_builds(kl):
    """A bf16 float layer on such a build runs on these kernels (CpuPackedLinear), not oneDNN's bf16 path."""

    class Layer:
        dtype, in_features = torch.bfloat16, 64

    assert isinstance(unquantized.method("cpu", Layer(), kl), CpuPackedLinear)
    Layer.in_features = 63  # an odd input size has no K pairs
    assert not isinstance(unquantized.method("cpu", Layer(), kl), CpuPackedLinear)


def test_dtype_auto_keeps_bf16_where_the_kernels_multiply_it(kl, monkeypatch):
    """On a CPU without bf16 instructions, `auto` is bf16 where the C kernels' build multiplies bf16 weights (these
    builds), float32 where the kernels are unavailable (torch's bf16 matmuls are slow there)."""
    monkeypatch.setattr(config, "cpu_has_fast_bf16", lambda: False)
    monkeypatch.setattr(cpu, "lib", lambda: kl)
    assert config.resolve_dtype("auto", "cpu") == "bfloat16"
    assert config.resolve_dtype("float32", "cpu") == "float32"
    monkeypatch.setattr(cpu, "lib", lambda: None)
    assert config.resolve_dtype("auto", "cpu") == "float32"
    assert config.resolve_dtype("auto", "cuda") == "bfloat16"


@pytest.mark.parametrize("arch", ["llama-tied", "qwen2"])  # an LM head the embedding reads; biases
def test_a_bf16_model_on_this_build_matches_transformers(kl, arch, monkeypatch):
    """A tiny random model in bf16 on this build's kernels (its linear layers on the float32-math bf16 kernels)
    against transformers' float32 forward on the same bf16-rounded weights: prefill logits and a few greedy steps."""
    import transformers as tf
    from kv_helpers import kv_of
    from tiny_models import tiny_model_dir

    from radixgen.runtime.config import RuntimeConfig
    from radixgen.runtime.executor.model_runner import ForwardInput, ModelRunner

    monkeypatch.setattr(cpu, "_lib", kl)
    folder = tiny_model_dir(arch)
    runner = ModelRunner(RuntimeConfig(model=str(folder), dtype="bfloat16", max_total_tokens=512,
                                       max_running_requests=2))
    names = {m.method.name for m in runner.model.modules() if hasattr(m, "method")}
    assert "bf16 K pairs (C)" in names, names
    ref = tf.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16).float().eval()
    tokens = torch.randint(3, 49152, (23,), generator=torch.Generator().manual_seed(0)).tolist()
    kv = kv_of(runner)
    row = kv.table.allocate()
    slots = kv.allocator.allocate(len(tokens) + 3)
    kv.table.write(row, 0, slots)
    n = len(tokens)
    logits = runner.forward(ForwardInput(torch.tensor(tokens), torch.arange(n), slots[:n], torch.tensor([row]), [0],
                                         [n], torch.arange(n)))
    for _ in range(3):  # greedy decode steps
        nxt = int(logits[-1].argmax())
        with torch.no_grad():
            want = ref(torch.tensor([tokens])).logits[0, -1]
        assert ((logits[-1].float() - want).abs().max() / want.abs().max()).item() < 3e-2
        tokens.append(nxt)
        p = len(tokens) - 1
        logits = runner.forward(ForwardInput(torch.tensor([nxt]), torch.tensor([p]), slots[p:p + 1],
                                             torch.tensor([row]), [p], [1], torch.tensor([0])))
