"""benchmarks/bench_scale.py: its GGUF writer makes files of the planned types that radixgen loads from their own
blocks (a tiny shape, with the bundled model's tokenizer), weights finite and near the intended spread, and its
command line answers --help and refuses an unknown type by name."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")
BENCH = Path(__file__).resolve().parents[2] / "benchmarks"
sys.path.insert(0, str(BENCH))

from scale_gguf import SHAPES, T, random_blocks, write_gguf  # noqa: E402

from radixgen.runtime.config import RuntimeConfig  # noqa: E402
from radixgen.runtime.executor.model_runner import ForwardInput, ModelRunner  # noqa: E402
from radixgen.runtime.scheduler.kv_manager import KVCacheManager  # noqa: E402

TINY = SHAPES["tiny"]


def test_q4_k_m_plan_follows_llama_cpp():
    plan = {name: t for name, t, _, _ in SHAPES["1.7b"].plan("Q4_K_M")}
    six = [i for i in range(24) if plan[f"blk.{i}.ffn_down.weight"] == T.Q6_K]
    assert six == [0, 1, 2, 5, 8, 11, 14, 17, 20, 21, 22, 23]  # half the layers: the ends and every third between
    assert all(plan[f"blk.{i}.attn_v.weight"] == plan[f"blk.{i}.ffn_down.weight"] for i in range(24))
    assert plan["blk.3.attn_q.weight"] == T.Q4_K and plan["token_embd.weight"] == T.Q6_K  # tied: the head's type
    assert {t for n, t, _, _ in SHAPES["8b"].plan("Q4_K_M") if n in ("output.weight", "token_embd.weight")} == {
        T.Q6_K, T.Q4_K}
    with pytest.raises(ValueError, match="unknown file type 'Q3_K_S'"):
        TINY.plan("Q3_K_S")


@pytest.mark.parametrize("t", [T.Q4_0, T.Q4_K, T.Q6_K, T.Q8_0, T.MXFP4])
def test_random_blocks_are_finite_and_sane(t):
    w = gguf.dequantize(random_blocks(t, 64, 512, np.random.default_rng(0)), t)
    assert w.shape == (64, 512) and np.isfinite(w).all() and 0.005 < w.std() < 0.05, w.std()


def test_written_file_loads_in_radixgen(tmp_path, monkeypatch):
    """Q4_K_M: Q4_K and Q6_K layers and a tied Q6_K head, each tensor in its planned type, from its own blocks."""
    monkeypatch.setenv("RADIXGEN_CACHE", str(tmp_path / "cache"))
    path = write_gguf(tmp_path / "tiny-Q4_K_M.gguf", TINY, "Q4_K_M")
    reader = gguf.GGUFReader(str(path))
    assert {t.name: t.tensor_type for t in reader.tensors} == {n: t for n, t, _, _ in TINY.plan("Q4_K_M")}
    runner = ModelRunner(RuntimeConfig(model=str(path), quantization="gguf", dtype="float32", max_total_tokens=256,
                                       max_running_requests=2))
    kv = KVCacheManager.for_runner(runner)
    ids = list(range(1000, 1040))
    slots = kv.allocator.allocate(len(ids))
    kv.table.write(0, 0, slots)
    logits = runner.forward(ForwardInput(torch.tensor(ids), torch.arange(len(ids)), slots, torch.tensor([0]), [0],
                                         [len(ids)], torch.tensor([len(ids) - 1])))
    assert logits.shape[-1] == 49152 and torch.isfinite(logits).all()


def test_command_line():
    out = subprocess.run([sys.executable, str(BENCH / "bench_scale.py"), "--help"], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0 and "--sizes" in out.stdout and "--llama-venv" in out.stdout
    out = subprocess.run([sys.executable, str(BENCH / "bench_scale.py"), "--types", "Q9_9", "--no-llama"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "unknown type 'Q9_9'" in out.stderr
