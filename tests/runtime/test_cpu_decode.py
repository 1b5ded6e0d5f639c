"""The fused CPU decode step (all layers in one C call, bf16) against the unfused path on the same weights:
the same logits and the same KV written, over decode steps of requests with unequal contexts; and on the
default model, its error against a float32 run is no larger than the unfused bf16 path's."""

from __future__ import annotations

import pytest
import torch
from kv_helpers import kv_of
from tiny_models import tiny_model_dir

from radixgen.kernels import cpu, cpu_fused, cpu_linear
from radixgen.runtime.config import RuntimeConfig
from radixgen.runtime.executor import cpu_decode
from radixgen.runtime.executor.model_runner import ForwardInput, ModelRunner
from radixgen.runtime.layers.linear import LinearBase

pytestmark = pytest.mark.skipif(not (cpu.available() and cpu.lib().has_decode_step),
                                reason="the fused decode step needs the CPU kernels built with AVX512-BF16")


def runner_for(model: str, dtype: str = "bfloat16", **kw) -> ModelRunner:
    return ModelRunner(RuntimeConfig(model=model, dtype=dtype, max_total_tokens=4096, max_running_requests=24, **kw))


def drive(runner: ModelRunner, prompts: list[list[int]], steps: int, forced: list[int] | None = None):
    """Prefill (unfused, as the scheduler's extend), then `steps` decode steps feeding back the argmax (or
    `forced` tokens); the logits of every decode step and a copy of the pool."""
    b = len(prompts)
    rows, lens = list(range(b)), [len(p) for p in prompts]
    slots = [kv_of(runner).allocator.allocate(n) for n in lens]
    for row, s in zip(rows, slots, strict=True):
        kv_of(runner).table.write(row, 0, s)
    ids = torch.tensor([t for p in prompts for t in p])
    pos = torch.cat([torch.arange(n) for n in lens])
    out = runner.forward(ForwardInput(ids, pos, torch.cat(slots), torch.tensor(rows), [0] * b, lens,
                                      torch.tensor(lens).cumsum(0) - 1))
    logits = []
    for step in range(steps):
        nxt = torch.tensor([forced[step]] * b) if forced else out.argmax(-1)
        s = kv_of(runner).allocator.allocate(b)
        for i, row in enumerate(rows):
            kv_of(runner).table.write(row, lens[i], s[i:i + 1])
        out = runner.forward(ForwardInput(nxt, torch.tensor(lens), s, torch.tensor(rows), list(lens), [1] * b,
                                          torch.arange(b)))
        logits.append(out)
        lens = [n + 1 for n in lens]
    return torch.stack(logits), [k.clone() for k in runner.kv_pool.k_buffers], \
        [v.clone() for v in runner.kv_pool.v_buffers]


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "llama-tied", "llama-hd64"])
@pytest.mark.parametrize("batch", [1, 3, 8, 21])  # 21: input rows through the kernel 8 + 8 + 4 + 1
def test_fused_step_matches_unfused_path(arch, batch):
    folder = str(tiny_model_dir(arch))
    fused, plain = runner_for(folder), runner_for(folder)
    assert fused.fused_decode is not None
    plain.fused_decode = None
    for r in (fused, plain):  # checkpoints initialise biases to zero: give them values that show
        for layer in r.model.layers:
            if layer.self_attn.qkv_proj.bias is not None:
                layer.self_attn.qkv_proj.bias.copy_(torch.randn(layer.self_attn.qkv_proj.bias.shape,
                                                                generator=torch.Generator().manual_seed(1)))
    gen = torch.Generator().manual_seed(batch)
    prompts = [torch.randint(3, 49152, (n,), generator=gen).tolist() for n in torch.randint(1, 40, (batch,),
                                                                                            generator=gen).tolist()]
    calls = []
    real = cpu_fused.decode_step
    cpu_decode.cpu_fused.decode_step = lambda *a, **kw: calls.append(1) or real(*a, **kw)
    try:
        got, k_got, v_got = drive(fused, prompts, 6)
    finally:
        cpu_decode.cpu_fused.decode_step = real
    want, k_want, v_want = drive(plain, prompts, 6)
    assert len(calls) == 6  # every decode step took the fused path
    assert rel(got, want) < 1e-2
    assert (got.argmax(-1) == want.argmax(-1)).float().mean() >= 0.9
    for kg, kw, vg, vw in zip(k_got, k_want, v_got, v_want, strict=True):
        assert rel(kg.float(), kw.float()) < 1e-2 and rel(vg.float(), vw.float()) < 1e-2


@pytest.mark.parametrize("arch", ["llama", "llama-tied", "qwen3"])
def test_prefill_logits_on_the_packed_lm_head(arch):
    """A bf16 prefill's sampled rows go through the fused step's LM head straight into float32 logits: those of the
    head's own matmul within bf16 rounding, and the kernel really ran; more rows than a decode batch go through
    the LM head layer."""
    folder = str(tiny_model_dir(arch))
    fused, plain = runner_for(folder), runner_for(folder)
    plain.fused_decode = None
    gen = torch.Generator().manual_seed(3)
    lens = [5, 17, 2]
    ids = torch.randint(3, 49152, (sum(lens),), generator=gen)
    pos = torch.cat([torch.arange(n) for n in lens])
    last = torch.tensor(lens).cumsum(0) - 1
    calls = []
    real = cpu_fused.lm_head_logits
    cpu_decode.cpu_fused.lm_head_logits = lambda *a: calls.append(a[2].shape[0]) or real(*a)
    try:
        outs = []
        for r in (fused, plain):
            slots = [kv_of(r).allocator.allocate(n) for n in lens]
            for row, s_ in enumerate(slots):
                kv_of(r).table.write(row, 0, s_)
            outs.append(r.forward(ForwardInput(ids, pos, torch.cat(slots), torch.arange(3), [0] * 3, lens, last)))
        every = torch.arange(sum(lens)).repeat(4)[:cpu_decode.MAX_BATCH + 1]  # too many rows: the oneDNN head
        r = fused
        slots = kv_of(r).allocator.allocate(sum(lens))
        kv_of(r).table.write(5, 0, slots)
        wide = r.forward(ForwardInput(ids, torch.arange(sum(lens)), slots, torch.tensor([5]), [0], [sum(lens)], every))
    finally:
        cpu_decode.cpu_fused.lm_head_logits = real
    got, want = outs
    assert calls == [3]
    assert got.dtype == torch.float32 and got.shape == want.shape
    assert rel(got, want) < 1e-2 and (got.argmax(-1) == want.argmax(-1)).all()
    assert wide.shape == (cpu_decode.MAX_BATCH + 1, want.shape[1])


@pytest.mark.parametrize("arch", ["llama-hd64", "qwen3-hd32"])
def test_steps_compute_only_their_logit_rows_bit_exactly(arch):
    """bf16 on the C extend kernel: a step whose logits are wanted at a few rows runs its last layer for those
    rows alone (attention by the extend kernel, one vector lane per token, so no row sees another), giving the
    very bits of the full computation; a chunk whose logits nobody wants still stores the K/V that the next
    chunk reads."""
    folder = str(tiny_model_dir(arch))
    gen = torch.Generator().manual_seed(4)
    a, b = (torch.randint(3, 49152, (n,), generator=gen) for n in (21, 13))
    keep = [14, 2, 22, 15]  # of the second step's 23 tokens: a's last and 3rd, b's last and first

    def run(first_rows, second_rows):
        r = runner_for(folder)
        rows, lens, out = [0, 1], [0, 0], None
        for chunk_a, chunk_b, logit_rows in ((a[:6], b[:5], first_rows), (a[6:], b[5:], second_rows)):
            ext = [len(chunk_a), len(chunk_b)]
            slots = [kv_of(r).allocator.allocate(n) for n in ext]
            for row, p, s_ in zip(rows, lens, slots, strict=True):
                kv_of(r).table.write(row, p, s_)
            pos = torch.cat([torch.arange(p, p + e) for p, e in zip(lens, ext, strict=True)])
            out = r.forward(ForwardInput(torch.cat([chunk_a, chunk_b]), pos, torch.cat(slots), torch.tensor(rows),
                                         list(lens), ext, torch.tensor(logit_rows, dtype=torch.int64)))
            lens = [p + e for p, e in zip(lens, ext, strict=True)]
        return out

    q_rows = []
    real = cpu._extend_attention
    cpu.__dict__["_extend_attention"] = lambda kl, q, *a_, **k_: q_rows.append(q.shape[0]) or real(kl, q, *a_, **k_)
    try:
        kept = run([], keep)
    finally:
        cpu.__dict__["_extend_attention"] = real
    full = run(list(range(11)), list(range(23)))[keep]
    assert torch.equal(kept, full)
    n_layers = len(runner_for(folder).model.layers)
    assert q_rows == [11] * (n_layers - 1) + [23] * (n_layers - 1) + [4]  # the first chunk's last layer: none


def test_lm_head_logits_checks_its_input():
    r = runner_for(str(tiny_model_dir("llama")))
    w = r.fused_decode.weights
    with pytest.raises(ValueError, match="hidden"):
        cpu_fused.lm_head_logits(r.fused_decode.kl, w, torch.ones(2, w.hidden + 2, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="hidden"):
        cpu_fused.lm_head_logits(r.fused_decode.kl, w, torch.ones(2, w.hidden))


def test_fused_step_is_as_accurate_as_unfused_on_default_model():
    from transformers import AutoTokenizer

    from radixgen.runtime.loader import resolve_model_path

    path = str(resolve_model_path(None))
    tok = AutoTokenizer.from_pretrained(path)
    texts = ["The history of the Roman Empire spans many centuries, beginning with",
             "def fibonacci(n):\n    if n < 2:\n        return n\n    return",
             "In 1969, the Apollo 11 mission"]
    prompts = [tok(t)["input_ids"] for t in texts]
    forced = tok(" the first time in a long")["input_ids"]
    ref = drive(runner_for(path, "float32"), prompts, len(forced), forced)[0]
    plain_runner = runner_for(path)
    plain_runner.fused_decode = None
    plain = drive(plain_runner, prompts, len(forced), forced)[0]
    fused_runner = runner_for(path)
    assert fused_runner.fused_decode is not None
    fused = drive(fused_runner, prompts, len(forced), forced)[0]
    assert rel(fused, ref) < 1.5 * rel(plain, ref) + 5e-3
    assert rel(fused, ref) < 5e-2


def test_where_the_fused_step_does_not_apply():
    assert runner_for(str(tiny_model_dir("llama")), "float32").fused_decode is None
    assert runner_for(str(tiny_model_dir("llama")), disable_cpu_kernels=True).fused_decode is None
    r = runner_for(str(tiny_model_dir("llama")))
    assert r.fused_decode.applies([1] * cpu_decode.MAX_BATCH)
    assert not r.fused_decode.applies([1] * (cpu_decode.MAX_BATCH + 1))
    assert not r.fused_decode.applies([1, 3])


def test_decode_step_weights_check_their_tensors():
    bf = torch.bfloat16

    def pw(n, k):
        return cpu_linear.pack_bf16(torch.ones(n, k))

    layer = {"input_norm": torch.ones(8, dtype=bf), "qkv": pw(16, 8), "qkv_bias": None, "o": pw(8, 8),
             "post_norm": torch.ones(8, dtype=bf), "gate_up": pw(12, 8), "down": pw(8, 6),
             "k_buf": torch.zeros(4, 1, 4, dtype=bf), "v_buf": torch.zeros(4, 1, 4, dtype=bf)}
    kw = {"num_heads": 2, "num_kv_heads": 1, "head_dim": 4, "intermediate": 6, "eps": 1e-6,
          "embed": cpu_linear.pack_rows(torch.ones(40, 8, dtype=bf))}
    kl = cpu.lib()
    w = cpu_fused.DecodeStepWeights(kl, [layer], torch.ones(8, dtype=bf), **kw)  # consistent: accepted
    assert w.layers[0].gate_up.N == 12 and w.layers[0].gate_up.data == layer["gate_up"].data.data_ptr()  # not copied
    with pytest.raises(ValueError, match="layer 0 qkv"):
        cpu_fused.DecodeStepWeights(kl, [{**layer, "qkv": pw(15, 8)}], torch.ones(8, dtype=bf), **kw)
    with pytest.raises(ValueError, match="layer 0 down"):
        cpu_fused.DecodeStepWeights(kl, [{**layer, "down": torch.ones(8, 6, dtype=bf)}], torch.ones(8, dtype=bf), **kw)
    with pytest.raises(ValueError, match="layer 0 input_norm"):
        cpu_fused.DecodeStepWeights(kl, [{**layer, "input_norm": torch.ones(8)}], torch.ones(8, dtype=bf), **kw)
    with pytest.raises(ValueError, match="layer 0 gate_up"):
        cpu_fused.DecodeStepWeights(kl, [layer], torch.ones(8, dtype=bf), **{**kw, "intermediate": 5})
    w = cpu_fused.DecodeStepWeights(kl, [layer], torch.ones(8, dtype=bf), **kw, lm_head=pw(40, 8))
    assert w.vocab == 40
    with pytest.raises(ValueError, match="lm_head"):
        cpu_fused.DecodeStepWeights(kl, [layer], torch.ones(8, dtype=bf), **kw, lm_head=pw(40, 6))
    with pytest.raises(ValueError, match="lm_head"):  # a rows table is no matmul weight
        cpu_fused.DecodeStepWeights(kl, [layer], torch.ones(8, dtype=bf), **kw, lm_head=kw["embed"])


def test_fused_step_reads_the_layers_own_weights():
    """One copy of every weight: the fused step's descriptors point at the layers' packed layouts (the tied
    embedding at the LM head's), and no layer keeps a dense weight besides."""
    r = runner_for(str(tiny_model_dir("llama-tied")))
    w, model = r.fused_decode.weights, r.model
    layer = model.layers[1]
    assert w.layers[1].qkv.data == layer.self_attn.qkv_proj.packed.data.data_ptr()
    assert w.layers[1].down.data == layer.mlp.down_proj.packed.data.data_ptr()
    assert w.lm_head is model.lm_head.packed and w.embed is model.lm_head.packed
    assert model.embed_tokens.weight is None and model.lm_head.weight is None
    assert all(m.weight is None for m in model.modules() if isinstance(m, LinearBase))
    # and the layouts lie back to back in one arena, in the order the step streams them (cpu_linear.gather)
    packed = [m.packed for m in model.modules() if isinstance(m, LinearBase)]
    starts = [p.data.data_ptr() for p in packed]
    assert len({p.data.untyped_storage().data_ptr() for p in packed}) == 1
    assert all(b == a + -(-p.nbytes // 64) * 64 for a, b, p in zip(starts, starts[1:], packed, strict=False))


def test_kpair_packing_layout():
    """The packed layout: block b, pair p, row j holds w[16 b + j, 2p : 2p + 2]; rows past N are zero."""
    w = torch.arange(20 * 6, dtype=torch.float32).reshape(20, 6).to(torch.bfloat16)
    out = cpu_linear.pack_bf16(w).data
    view = out.view(2, 3, 16, 2)  # (blocks, pairs, rows, 2)
    padded = torch.cat([w, torch.zeros(12, 6, dtype=torch.bfloat16)]).view(2, 16, 3, 2).transpose(1, 2)
    assert torch.equal(view, padded)


@pytest.mark.parametrize("arch", ["llama-hd64", "qwen3-hd32", "llama"])  # the last: head_dim 16, torch extend
def test_bf16_prefill_and_cached_prefix_extend_match_torch_path(arch, monkeypatch):
    """The C extend attention (bf16 prefill, and extends after a prefix already in scattered pool slots)
    gives the torch path's logits, at every position."""
    folder = str(tiny_model_dir(arch))
    c_runner, torch_runner = runner_for(folder), runner_for(folder, disable_cpu_kernels=True)
    calls = []
    real = cpu._extend_attention
    monkeypatch.setattr(cpu, "_extend_attention", lambda *a: calls.append(1) or real(*a))
    gen = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, 49152, (n,), generator=gen).tolist() for n in (37, 5, 70)]
    outs = []
    for r in (c_runner, torch_runner):
        free = kv_of(r).allocator.allocate(kv_of(r).allocator.available())  # scatter the slots
        kv_of(r).allocator.free(free[torch.randperm(free.numel(), generator=torch.Generator().manual_seed(0))])
        rows, steps = [0, 1, 2], []
        for lo, hi in ((0, 20), (20, None)):  # a prefill of the first 20 tokens, then an extend after them
            parts = [p[lo:hi] for p in prompts]
            ids, pos, slots, prefix, ext = [], [], [], [], []
            for row, p, part in zip(rows, prompts, parts, strict=True):
                s = kv_of(r).allocator.allocate(len(part))
                kv_of(r).table.write(row, min(lo, len(p)), s)
                ids += part
                pos += range(min(lo, len(p)), min(lo, len(p)) + len(part))
                slots.append(s)
                prefix.append(min(lo, len(p)))
                ext.append(len(part))
            keep = [i for i, e in enumerate(ext) if e > 0]
            fi = ForwardInput(torch.tensor(ids), torch.tensor(pos), torch.cat(slots), torch.tensor(rows)[keep],
                              [prefix[i] for i in keep], [ext[i] for i in keep], torch.arange(len(ids)))
            steps.append(r.forward(fi))
        outs.append(torch.cat(steps))
    head_dim = c_runner.model_config.head_dim
    assert len(calls) == (2 * c_runner.model_config.num_layers if head_dim % 32 == 0 else 0)
    assert rel(outs[0], outs[1]) < 2e-2
    assert (outs[0].argmax(-1) == outs[1].argmax(-1)).float().mean() >= 0.9


def test_decode_step_reports_failure_instead_of_writing():
    """The fused step allocates nothing: its caller's scratch is sized for the longest context it was told of, and
    a step reading a longer one is refused with an exception before anything is written (never an overrun)."""
    r = runner_for(str(tiny_model_dir("llama")))
    fd = r.fused_decode
    w = cpu_fused.DecodeStepWeights(fd.kl, [dict(ly) for ly in fd.weights.keep[0]], fd.weights.final_norm,
                                    num_heads=fd.weights.num_heads, num_kv_heads=fd.weights.num_kv_heads,
                                    head_dim=fd.weights.head_dim, intermediate=fd.weights.intermediate,
                                    eps=fd.weights.eps, embed=fd.weights.embed)
    one = torch.ones(1, dtype=torch.int64)
    k_before = r.kv_pool.k_buffers[0].clone()
    with pytest.raises(cpu.CKernelError, match="scratch buffer is too small"):
        cpu_fused.decode_step(fd.kl, w, one, one * 300, fd.cos_sin_cache, one, r.req_to_slot, one * 0,
                              1, fd.scale)  # position 300, but the longest context given as 1
    assert torch.equal(r.kv_pool.k_buffers[0], k_before)


def test_a_prefills_logits_rows_have_the_fused_steps_bits():
    """A prefill step of 20 rows that all become logits (prompt logprobs): the same bits with and without the fused
    step, since both compute up to its batch of logits rows on its kernels (on AMX CPUs the layer-by-layer path's
    LM head would otherwise take the prefill GEMM from 8 rows up)."""
    folder = str(tiny_model_dir("qwen3"))
    fused, plain = runner_for(folder), runner_for(folder)
    plain.fused_decode = None
    assert fused.fused_decode is not None
    gen = torch.Generator().manual_seed(4)
    ids = torch.randint(3, 49152, (20,), generator=gen)
    got = []
    for runner in (fused, plain):
        s = kv_of(runner).allocator.allocate(20)
        kv_of(runner).table.write(0, 0, s)
        got.append(runner.forward(ForwardInput(ids, torch.arange(20), s, torch.tensor([0]), [0], [20],
                                               torch.arange(20))))
    assert got[0].shape == (20, fused.model_config.vocab_size) and torch.equal(got[0], got[1])
