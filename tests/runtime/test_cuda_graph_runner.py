"""CudaGraphRunner: padded static-buffer decode steps against the eager forward, and the config / CLI flags.

Each mode runs the same requests through two runners with the same weights and the same slot placement: `eager`
(ModelRunner.forward_eager) and `graphed` (ModelRunner.forward, which sends decode steps to its graph runner).
- cpu-torch: the graph runner in eager mode (capture=False) with the CPU ops (C kernels, no prepare_static);
- cpu-triton: the same with the Triton ops under the interpreter, i.e. prepare_static's path of a graph;
- cuda: real CUDA graphs (skipped without a GPU).
Per decode step: logits of the real rows match, both pools hold the same K/V in every slot but the padding
slot 0, no slot or table row is allocated by the graph path, padding rows hold the padding values.
"""

from __future__ import annotations

import os

import pytest
import torch
from kv_helpers import kv_of
from tiny_models import tiny_model_dir

from radixgen.runtime.config import RuntimeConfig
from radixgen.runtime.executor.cuda_graph_runner import CudaGraphRunner, batch_size_buckets
from radixgen.runtime.executor.model_runner import ForwardInput, ModelRunner

CPU_BATCHES = [1, 3, 5, 3, 1, 5]  # buckets 1, 4, 8, 4 (rows left by the 5-batch re-padded), 1, 8
CUDA_BATCHES = [1, 3, 17, 3, 1]
TOL = {"cpu-torch": 1e-5, "cpu-triton": 1e-5, "cuda": 1e-3}


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).abs().max() / b.double().abs().max()).item()


def make_runner(device: str, max_reqs: int, ops=None, **kw) -> ModelRunner:
    cfg = RuntimeConfig(model=str(tiny_model_dir("llama")), dtype="float32", device=device, max_total_tokens=600,
                        max_running_requests=max_reqs, **kw)
    return ModelRunner(cfg, ops=ops)


def use_triton_interpreter() -> None:
    # triton decides at import (its own library) and at our kernel modules' import (first launch)
    os.environ["TRITON_INTERPRET"] = "1"
    pytest.importorskip("triton")
    import triton.language as tl
    from triton.runtime.interpreter import InterpretedFunction

    from radixgen.kernels import _triton_env

    if not (_triton_env.INTERPRET and isinstance(tl.cdiv, InterpretedFunction)):
        pytest.skip("triton was imported without TRITON_INTERPRET=1 earlier in this process")


@pytest.fixture(scope="module", params=["cpu-torch", "cpu-triton", "cuda"])
def mode(request):
    if request.param == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    return request.param


def build_pair(mode: str, kv_cache_dtype: str = "auto") -> tuple[ModelRunner, ModelRunner]:
    if mode == "cuda":
        eager = make_runner("cuda", 24, disable_cuda_graph=True, kv_cache_dtype=kv_cache_dtype)
        graphed = make_runner("cuda", 24, kv_cache_dtype=kv_cache_dtype)
        assert eager.cuda_graph_runner is None and graphed.cuda_graph_runner.capture_graphs
        assert graphed.cuda_graph_runner.buckets == [1, 2, 4, 8, 16, 24]
        return eager, graphed
    ops = None
    if mode == "cpu-triton":
        use_triton_interpreter()
        from radixgen.runtime.layers.ops import TritonOps

        ops = TritonOps
    eager, graphed = (make_runner("cpu", 8, ops and ops(), kv_cache_dtype=kv_cache_dtype) for _ in range(2))
    assert graphed.cuda_graph_runner is None  # never on the CPU: tests attach one in eager mode
    graphed.cuda_graph_runner = CudaGraphRunner(graphed, capture=False)
    assert graphed.cuda_graph_runner.buckets == [1, 2, 4, 8]
    return eager, graphed


class Mirror:
    """The same requests in the same slots and table rows of two runners; slots are scattered (shuffled)."""

    def __init__(self, eager: ModelRunner, graphed: ModelRunner, seed: int = 0) -> None:
        self.runners = (eager, graphed)
        for r in self.runners:
            free = kv_of(r).allocator.allocate(kv_of(r).allocator.available())
            kv_of(r).allocator.free(free[torch.randperm(free.numel(), generator=torch.Generator().manual_seed(seed))])
        self.rows: list[dict[str, int]] = [{}, {}]
        self.lens: dict[str, int] = {}

    def inputs(self, new_tokens: dict[str, list[int]], logit_rows: list[int] | None = None) -> list[ForwardInput]:
        """Allocate slots (and a table row for a new name) in both runners; one ForwardInput per runner."""
        out = []
        for r, rows_of in zip(self.runners, self.rows, strict=True):
            ids, pos, slots, rows, prefix, ext = [], [], [], [], [], []
            for name, toks in new_tokens.items():
                if name not in rows_of:
                    rows_of[name] = kv_of(r).table.allocate()
                p = self.lens.get(name, 0)
                s = kv_of(r).allocator.allocate(len(toks))
                kv_of(r).table.write(rows_of[name], p, s)
                ids += toks
                pos += range(p, p + len(toks))
                slots.append(s)
                rows.append(rows_of[name])
                prefix.append(p)
                ext.append(len(toks))
            lr = torch.tensor(logit_rows) if logit_rows is not None else torch.arange(len(ids))
            out.append(ForwardInput(torch.tensor(ids), torch.tensor(pos), torch.cat(slots), torch.tensor(rows),
                                    prefix, ext, lr))
        assert torch.equal(out[0].out_slots.cpu(), out[1].out_slots.cpu()) and self.rows[0] == self.rows[1]
        for name, toks in new_tokens.items():
            self.lens[name] = self.lens.get(name, 0) + len(toks)
        return out


def prompts(n: int, seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    lens = torch.randint(2, 30, (n,), generator=gen).tolist()
    return [torch.randint(3, 49152, (length,), generator=gen).tolist() for length in lens]


def assert_same_kv(eager: ModelRunner, graphed: ModelRunner, tol: float) -> None:
    """Every slot but the padding slot 0 holds the same K/V in both pools (both start all zeros); an 8-bit pool
    the same codes and scales."""
    pools = [(r.kv_pool.k_buffers, r.kv_pool.v_buffers, r.kv_pool.k_scales or [], r.kv_pool.v_scales or [])
             for r in (eager, graphed)]
    for bufs_e, bufs_g in zip(*pools, strict=True):
        for e, g in zip(bufs_e, bufs_g, strict=True):
            e, g = e.float().flatten(1), g.float().flatten(1)
            diff = (e[1:] - g[1:]).abs().amax(dim=1)
            assert diff.max().item() <= tol * max(e[1:].abs().max().item(), 1.0), diff.nonzero().flatten()[:8]


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "int8"])  # the graphs over an 8-bit pool's codes and scales
def test_decode_steps_match_eager(mode, kv_cache_dtype):
    eager, graphed = build_pair(mode, kv_cache_dtype)
    g = graphed.cuda_graph_runner
    batches = CUDA_BATCHES if mode == "cuda" else CPU_BATCHES
    tol = TOL[mode]
    n = max(batches)
    names = [f"r{i}" for i in range(n)]
    m = Mirror(eager, graphed, seed=1)
    last: dict[str, int] = {}
    for name, prompt in zip(names, prompts(n, seed=2), strict=True):
        fe, fg = m.inputs({name: prompt})
        le, lg = eager.forward_eager(fe), graphed.forward(fg)  # extend: both eager
        assert rel_err(lg, le) < tol
        last[name] = int(le[-1].argmax())
    assert g.replays == 0
    free_slots = [kv_of(r).allocator.available() for r in (eager, graphed)]
    free_rows = [kv_of(r).table.available() for r in (eager, graphed)]
    assert_same_kv(eager, graphed, tol)

    for step, bs in enumerate(batches):
        batch = names[:bs] if step % 2 == 0 else names[n - bs:]  # different rows in different positions
        fe, fg = m.inputs({name: [last[name]] for name in batch})
        le, lg = eager.forward_eager(fe), graphed.forward(fg)
        assert g.replays == step + 1
        assert lg.shape == le.shape == (bs, eager.vocab_size)
        assert rel_err(lg, le) < tol, (step, bs)
        for name, row in zip(batch, le, strict=True):
            last[name] = int(row.argmax())
        assert_same_kv(eager, graphed, tol)
        # padding: rows [bs, bucket) of the static inputs hold the padding values
        bucket = g.bucket_for(bs)
        pad = torch.stack([g.input_ids, g.positions, g.out_slots, g.req_indices, g.seq_lens])[:, bs:bucket].cpu()
        expect = torch.tensor([0, 0, 0, kv_of(graphed).table.padding_row, 1]).unsqueeze(1).expand_as(pad)
        assert torch.equal(pad, expect)
        assert torch.equal(g.seq_lens[:bs].cpu(), torch.tensor(fg.prefix_lens) + 1)
        free_slots = [f - bs for f in free_slots]
        assert [kv_of(r).allocator.available() for r in (eager, graphed)] == free_slots  # no slot taken or freed
        assert [kv_of(r).table.available() for r in (eager, graphed)] == free_rows
    # the padding row was never written; eager never touched slot 0, the padded steps did
    assert not kv_of(graphed).table.table[kv_of(graphed).table.padding_row].any()
    assert not eager.kv_pool.k_buffers[0][0].any()
    assert graphed.kv_pool.k_buffers[0][0].any()


def test_logit_rows_subset_and_order(mode):
    """Only the asked rows come back, in the asked order, and they are copies of the static buffer."""
    eager, graphed = build_pair(mode)
    m = Mirror(eager, graphed, seed=3)
    ps = prompts(3, seed=4)
    for i, p in enumerate(ps):
        fe, fg = m.inputs({f"r{i}": p})
        eager.forward_eager(fe), graphed.forward(fg)
    fe, fg = m.inputs({f"r{i}": [5 + i] for i in range(3)}, logit_rows=[2, 0])
    le, lg = eager.forward_eager(fe), graphed.forward(fg)
    assert lg.shape == (2, eager.vocab_size)
    assert rel_err(lg, le) < TOL[mode]
    before = lg.clone()
    fe, fg = m.inputs({f"r{i}": [9] for i in range(3)})
    graphed.forward(fg)
    assert torch.equal(lg, before)  # the next replay did not change the returned tensor


def test_fallbacks_to_eager():
    """Extend steps and decode batches above the largest bucket do not go through the graph runner."""
    eager, graphed = make_runner("cpu", 8), make_runner("cpu", 8)
    graphed.cuda_graph_runner = g = CudaGraphRunner(graphed, max_bs=2, capture=False)
    assert g.buckets == [1, 2]
    m = Mirror(eager, graphed, seed=5)
    ps = prompts(3, seed=6)
    fe, fg = m.inputs({f"r{i}": p for i, p in enumerate(ps)})
    assert rel_err(graphed.forward(fg), eager.forward_eager(fe)) < 1e-5
    fe, fg = m.inputs({f"r{i}": [7] for i in range(3)})  # decode of 3 > 2
    assert rel_err(graphed.forward(fg), eager.forward_eager(fe)) < 1e-5
    assert g.replays == 0
    fe, fg = m.inputs({"r0": [8], "r2": [9]})  # decode of 2
    assert rel_err(graphed.forward(fg), eager.forward_eager(fe)) < 1e-5
    assert g.replays == 1
    fe, fg = m.inputs({"r0": [8, 9]})  # two new tokens: extend
    assert not g.can_run(fg)
    graphed.forward(fg)
    assert g.replays == 1
    with pytest.raises(ValueError):
        g.replay(fg)
    assert graphed.cuda_graph_info() == {"enabled": True, "captured": False, "buckets": [1, 2], "replays": 1}
    assert eager.cuda_graph_info() == {"enabled": False}


def test_capture_needs_cuda():
    runner = make_runner("cpu", 4)
    with pytest.raises(RuntimeError, match="CUDA"):
        CudaGraphRunner(runner)


def test_batch_size_buckets():
    assert batch_size_buckets(1) == [1]
    assert batch_size_buckets(5) == [1, 2, 4, 5]
    assert batch_size_buckets(8) == [1, 2, 4, 8]
    assert batch_size_buckets(20) == [1, 2, 4, 8, 16, 20]
    b = batch_size_buckets(160)
    assert b[:6] == [1, 2, 4, 8, 16, 24] and b[-1] == 160
    assert all(y - x == 8 for x, y in zip(b[4:-1], b[5:], strict=True))
    with pytest.raises(ValueError):
        batch_size_buckets(0)


def test_largest_bucket_from_config():
    runner = make_runner("cpu", 12, cuda_graph_max_bs=10)
    assert CudaGraphRunner(runner, capture=False).buckets == [1, 2, 4, 8, 10]
    runner = make_runner("cpu", 6)
    g = CudaGraphRunner(runner, capture=False)
    assert g.buckets == [1, 2, 4, 6] and g.bucket_for(5) == 6 and g.bucket_for(3) == 4
    with pytest.raises(ValueError):
        g.bucket_for(7)


def test_config_and_cli_flags():
    import argparse

    from radixgen.runtime.server.launch import add_server_args, server_args_from

    def parse(*argv: str) -> RuntimeConfig:
        parser = argparse.ArgumentParser()
        add_server_args(parser)
        return RuntimeConfig.from_kwargs(**server_args_from(parser.parse_args(list(argv))).engine)

    default = parse()
    assert default.disable_cuda_graph is False and default.cuda_graph_max_bs == 160
    cfg = parse("--disable-cuda-graph", "--cuda-graph-max-bs", "64")
    assert cfg.disable_cuda_graph is True and cfg.cuda_graph_max_bs == 64
    assert RuntimeConfig.from_kwargs(disable_cuda_graph=True, cuda_graph_max_bs=8).cuda_graph_max_bs == 8
    with pytest.raises(ValueError, match="cuda_graph_max_bs"):
        RuntimeConfig(cuda_graph_max_bs=0)
