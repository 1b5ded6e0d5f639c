"""Our model code over the paged KV pool against transformers' forward on the same weights (float32)."""

from __future__ import annotations

import pytest
import torch
from kv_helpers import kv_of
from tiny_models import tiny_model_dir

from radixgen.runtime.config import RuntimeConfig
from radixgen.runtime.executor.model_runner import ForwardInput, ModelRunner

ARCHS = ["llama", "llama3", "llama-tied", "qwen2", "qwen3"]
TOL = 1e-4


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max()).item()


class Driver:
    """Places requests' tokens in scattered pool slots and runs extend / decode steps directly."""

    def __init__(self, runner: ModelRunner, seed: int = 0) -> None:
        self.runner = runner
        gen = torch.Generator().manual_seed(seed)
        # scatter: hand out slots in a random order, so no request's tokens are contiguous
        free = kv_of(runner).allocator.allocate(kv_of(runner).allocator.available())
        kv_of(runner).allocator.free(free[torch.randperm(free.numel(), generator=gen)])
        self.rows: dict[str, int] = {}
        self.lens: dict[str, int] = {}

    def step(self, new_tokens: dict[str, list[int]], keep: list[int] | None = None) -> dict[str, torch.Tensor]:
        """Append new tokens to each named request in one forward; return their logits rows. With `keep` (rows of
        the step's tokens), only those rows become logits, returned in that order under "kept"."""
        ids, pos, slots, rows, prefix, ext = [], [], [], [], [], []
        for name, toks in new_tokens.items():
            if name not in self.rows:
                self.rows[name], self.lens[name] = kv_of(self.runner).table.allocate(), 0
            p = self.lens[name]
            s = kv_of(self.runner).allocator.allocate(len(toks))
            kv_of(self.runner).table.write(self.rows[name], p, s)
            if kv_of(self.runner).window is not None:  # window layers: their own slots for the new positions
                kv_of(self.runner).window.extend(self.rows[name], p, s, lambda n: None)
            ids += toks
            pos += range(p, p + len(toks))
            slots.append(s)
            rows.append(self.rows[name])
            prefix.append(p)
            ext.append(len(toks))
            self.lens[name] = p + len(toks)
        t = len(ids)
        fi = ForwardInput(torch.tensor(ids), torch.tensor(pos), torch.cat(slots), torch.tensor(rows),
                          prefix, ext, torch.arange(t) if keep is None else torch.tensor(keep, dtype=torch.int64))
        logits = self.runner.forward(fi)
        if keep is not None:
            return {"kept": logits}
        out, start = {}, 0
        for name, e in zip(new_tokens, ext, strict=True):
            out[name] = logits[start:start + e]
            start += e
        return out

    def greedy(self, last: dict[str, torch.Tensor], seqs: dict[str, list[int]]) -> dict[str, torch.Tensor]:
        """One decode step feeding each request the argmax of its `last` logits row (appended to `seqs`); the
        new last rows."""
        nxt = {k: int(v.argmax()) for k, v in last.items()}
        out = self.step({k: [t] for k, t in nxt.items()})
        for k, t in nxt.items():
            seqs[k].append(t)
        return {k: v[-1] for k, v in out.items()}


# "c": the CPU path with radixgen.kernels.cpu and oneDNN-packed weights (the default); "torch": plain torch ops
PATHS = ["c", "torch"]


@pytest.fixture(scope="module", params=[(a, p) for a in ARCHS for p in PATHS], ids=lambda ap: f"{ap[0]}-{ap[1]}")
def pair(request):
    import transformers as tf

    arch, path = request.param
    folder = tiny_model_dir(arch)
    runner = ModelRunner(RuntimeConfig(model=str(folder), dtype="float32", max_total_tokens=4096,
                                       max_running_requests=8, disable_cpu_kernels=path == "torch"))
    ref = tf.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    return runner, ref


def ref_logits(ref, tokens: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return ref(torch.tensor([tokens])).logits[0].float()


def prompts(n: int, lens: list[int], seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 49152, (length,), generator=gen).tolist() for length in lens[:n]]


def test_batch_of_unequal_prompts(pair):
    runner, ref = pair
    ps = prompts(3, [7, 19, 3], seed=1)
    out = Driver(runner).step({f"r{i}": p for i, p in enumerate(ps)})
    for i, p in enumerate(ps):
        assert rel_err(out[f"r{i}"], ref_logits(ref, p)) < TOL


def test_extend_after_cached_prefix(pair):
    runner, ref = pair
    a, b = prompts(2, [24, 15], seed=2)
    d = Driver(runner, seed=3)
    d.step({"a": a[:10], "b": b[:4]})
    out = d.step({"a": a[10:], "b": b[4:]})  # prefix already in scattered slots
    assert rel_err(out["a"], ref_logits(ref, a)[10:]) < TOL
    assert rel_err(out["b"], ref_logits(ref, b)[4:]) < TOL


def test_only_the_rows_that_become_logits(pair):
    """A step whose logits are wanted at a few rows (a prefill's last tokens, prompt-logprob rows, none at all in
    a chunk that samples nothing): the last layer computes those rows alone, yet stores every row's K/V, which
    the next step's attention reads."""
    runner, ref = pair
    a, b = prompts(2, [21, 13], seed=8)
    d = Driver(runner, seed=9)
    try:
        assert d.step({"a": a[:6], "b": b[:5]}, keep=[])["kept"].shape[0] == 0  # a chunk no logits are wanted of
        out = d.step({"a": a[6:], "b": b[5:]}, keep=[14, 2, 22, 15])  # a: last, 3rd new token; b: last, first
    finally:  # the module's runner is shared: give its request rows back
        for row in d.rows.values():
            kv_of(runner).table.free(row)
    ra, rb = ref_logits(ref, a), ref_logits(ref, b)
    want = torch.stack([ra[20], ra[8], rb[12], rb[5]])
    assert rel_err(out["kept"], want) < TOL


def test_decode_steps_of_requests_started_at_different_times(pair):
    runner, ref = pair
    a, b = prompts(2, [9, 5], seed=4)
    d = Driver(runner, seed=5)
    seqs = {"a": list(a)}
    last = {"a": d.step({"a": a})["a"][-1]}
    for step in range(20):
        if step == 6:  # b arrives while a is decoding: a mixed extend+decode batch
            seqs["b"] = list(b)
            out = d.step({"a": [int(last["a"].argmax())], "b": b})
            seqs["a"].append(int(last["a"].argmax()))
            last = {k: v[-1] for k, v in out.items()}
            continue
        last = d.greedy(last, seqs)
        for k in last:
            assert rel_err(last[k], ref_logits(ref, seqs[k])[-1]) < TOL, (step, k)


def test_each_path_runs_the_kernels_it_claims(pair, monkeypatch):
    """The "c" runs really go through the C kernels and packed weights, the "torch" runs (TorchOps, the plain-torch
    reference the other ops sets fall back to) through neither."""
    from radixgen.kernels import cpu

    runner, _ = pair
    c_path = not runner.runtime_config.disable_cpu_kernels
    calls: dict[str, int] = {}
    for name in ("_decode_attention", "_store_kv", "_add_rmsnorm", "_rotary"):
        real = getattr(cpu, name)

        def counted(*a, _real=real, _name=name, **kw):
            calls[_name] = calls.get(_name, 0) + 1
            return _real(*a, **kw)

        monkeypatch.setattr(cpu, name, counted)
    d = Driver(runner, seed=7)
    (a,) = prompts(1, [6], seed=8)
    d.step({"a": a})
    d.step({"a": [5]})  # one decode step
    layers = runner.model_config.num_layers
    assert runner.ops.name == ("cpu" if c_path else "torch")
    assert runner.model.layers[0].input_layernorm.ops is runner.ops
    if c_path:
        assert calls["_decode_attention"] == layers and calls["_store_kv"] == 2 * layers
        assert calls["_add_rmsnorm"] == 2 * (2 * layers + 1)
        assert calls["_rotary"] == 2 * layers
        assert runner.model.layers[0].mlp.down_proj.packed is not None
    else:
        assert calls == {}
        assert runner.model.layers[0].mlp.down_proj.packed is None


def test_a_steps_logits_keep_the_row_kernels(monkeypatch):
    """The logits of up to the fused decode step's batch of rows are computed with the row-count-dependent routes
    off (forward_context.row_kernels), as that step computes them, whether or not it took the step: a prefill's
    logits rows then have the bits they would have in a decode step (on AMX CPUs the prefill GEMM rounds
    otherwise). More rows than that batch take the prefill routes."""
    import transformers as tf

    from radixgen.runtime.executor import cpu_decode
    from radixgen.runtime.ground.forward_context import in_decode_or_verify

    folder = tiny_model_dir("llama")
    runner = ModelRunner(RuntimeConfig(model=str(folder), dtype="float32", max_total_tokens=4096,
                                       max_running_requests=2))
    ref = tf.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    assert runner.fused_decode is None  # float32
    seen = []
    real = runner.model.compute_logits
    monkeypatch.setattr(runner.model, "compute_logits", lambda h: seen.append((h.shape[0], in_decode_or_verify()))
                        or real(h))
    big = cpu_decode.MAX_BATCH + 6
    a, b = prompts(2, [16, big], seed=10)
    d = Driver(runner, seed=11)
    out = d.step({"a": a})
    d.step({"b": b})
    assert seen == [(16, True), (big, False)]
    assert not in_decode_or_verify()
    assert rel_err(out["a"], ref_logits(ref, a)) < TOL
