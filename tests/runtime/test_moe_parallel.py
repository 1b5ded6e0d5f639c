"""Expert parallelism (--ep-size, SGLang's layout: expert groups of the tensor-parallel ranks) in spawned gloo
groups, one thread per rank, against one process on the same weights and steps (parallel_helpers.drive): tp 2 x
ep 2 (each rank 4 of the 8 experts), tp 2 x ep 1 (every rank half of each expert's columns), and tp 2 x ep 2 x
pp 2 (four ranks), float32 logits within rounding and the same argmax everywhere (also a GGUF file's expert
blocks at tp 2 x ep 2); bf16 through the fused C decode step at tp 2 x ep 2 and tp 2 x ep 1 (the expert block
inside the step, its partial sums through the step's all-reduce hook) giving the layer-by-layer path's bits at the
same layout; then the Engine (scheduler, paged KV, radix cache, ngram speculation's verification steps) at tp 2 x
ep 2 gives transformers' greedy tokens (the ep 1 model's), in one launch and as two "nodes" on loopback (node 1
its own `radixgen serve --node-rank 1`, one rank each)."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from parallel_helpers import run_group, run_single
from tiny_models import tiny_model_dir

from radixgen.kernels import cpu
from radixgen.runtime.engine import Engine

TOL = 1e-5


def rel_max(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max()).item()


@pytest.fixture(scope="module")
def single() -> dict:
    path = str(tiny_model_dir("qwen2_moe"))
    return {"path": path, "logits": run_single(path, dtype="float32")["logits"]}


@pytest.mark.parametrize("layout", [{"tp_size": 2, "ep_size": 2}, {"tp_size": 2, "ep_size": 1},
                                    {"tp_size": 2, "ep_size": 2, "pp_size": 2}],
                         ids=["tp2-ep2", "tp2-ep1", "tp2-ep2-pp2"])
def test_expert_parallel_logits_equal_one_process(single, layout):
    got = run_group(single["path"], dtype="float32", **layout)["logits"]
    assert got.shape == single["logits"].shape
    assert rel_max(got, single["logits"]) < TOL
    assert torch.equal(got.argmax(-1), single["logits"].argmax(-1))


def test_gguf_expert_blocks_over_ep2_equal_one_process(tmp_path, monkeypatch):
    """A .gguf file's Q4_0 / Q4_1 / Q8_0 expert stacks run from their blocks (quantization="gguf"), each rank
    taking its experts' blocks: the same logits as one process."""
    from test_moe_gguf import QUANTIZED_EXPERTS, write_moe_gguf

    from radixgen.runtime.loader import resolve_model_path

    folder = tiny_model_dir("qwen3_moe")
    monkeypatch.setenv("RADIXGEN_CACHE", str(tmp_path / "cache"))  # (the ranks inherit it)
    write_moe_gguf("qwen3_moe", folder, tmp_path / "q.gguf", QUANTIZED_EXPERTS["qwen3_moe"][0])
    native = str(resolve_model_path(str(tmp_path / "q.gguf"), "gguf"))
    want = run_single(native, dtype="float32", quantization="gguf")["logits"]
    got = run_group(native, dtype="float32", quantization="gguf", tp_size=2, ep_size=2)["logits"]
    assert rel_max(got, want) < TOL and torch.equal(got.argmax(-1), want.argmax(-1))


@pytest.mark.skipif(not (cpu.available() and cpu.lib().has_decode_step),
                    reason="the fused decode step needs the CPU kernels built with AVX512-BF16")
def test_fused_step_at_tp2_gives_the_layer_by_layer_bits():
    """Qwen2-MoE (routed experts, the gated shared expert, a dense layer) with intermediate sizes whose tp 2 shards
    are whole 16-column blocks. Against tp 1: bf16 rounds the ranks' partial sums apart, so the logits agree within
    rounding and the argmax wherever tp 1's top two are further apart than a few bf16 steps."""
    path = str(tiny_model_dir("qwen2_moe-wide"))
    one = run_single(path, dtype="bfloat16")
    assert one["fused"]
    top2 = one["logits"].topk(2, -1).values
    clear = top2[:, 0] - top2[:, 1] > 4 * 2.0 ** -7 * top2[:, 0].abs().clamp(min=1)
    assert clear.float().mean() > 0.5
    for layout in ({"tp_size": 2, "ep_size": 2}, {"tp_size": 2, "ep_size": 1}):
        fused = run_group(path, dtype="bfloat16", **layout)
        plain = run_group(path, dtype="bfloat16", fused=False, **layout)
        assert fused["fused"] and not plain["fused"], layout
        assert torch.equal(fused["logits"], plain["logits"]), layout
        got, want = fused["logits"], one["logits"]
        assert ((got - want).norm() / want.norm()).item() < 2e-2, layout
        assert torch.equal(got.argmax(-1)[clear], want.argmax(-1)[clear]), layout


def test_engine_ep2_greedy_equals_transformers():
    import transformers as tf

    folder = tiny_model_dir("mixtral")
    gen = torch.Generator().manual_seed(11)
    shared = torch.randint(3, 49152, (12,), generator=gen).tolist()
    prompts = [shared + torch.randint(3, 49152, (n,), generator=gen).tolist() for n in (3, 8)]
    params = {"max_new_tokens": 20, "temperature": 0, "ignore_eos": True}
    with Engine(model=str(folder), dtype="float32", tp_size=2, ep_size=2, num_threads=1, max_total_tokens=1024,
                max_running_requests=4, speculative_algorithm="ngram") as e:
        info = e.get_server_info()
        assert info["parallel"]["rank_pids"].keys() == {"0", "1"} and info["parallel"]["ep_size"] == 2
        first = e.generate(input_ids=prompts[0], sampling_params=params)
        second = e.generate(input_ids=prompts[1], sampling_params=params)  # its first 12 tokens from the tree
        again = e.generate(input_ids=prompts[0], sampling_params=params)  # drafted from the first's output
        spec = e.get_server_info()["speculative"]
    assert second["meta_info"]["cached_tokens"] >= 12
    assert again["output_ids"] == first["output_ids"] and spec["accepted_tokens"] > 0  # verification steps ran
    ref = tf.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    for p, out in zip(prompts, (first, second), strict=True):
        with torch.no_grad():
            want = ref.generate(torch.tensor([p]), max_new_tokens=20, min_new_tokens=20, do_sample=False)[0]
        assert out["output_ids"] == want[len(p):].tolist()


def test_ep2_across_two_nodes_greedy_equals_transformers():
    import transformers as tf
    from test_parallel_engine import free_port

    folder = tiny_model_dir("qwen3_moe")
    gen = torch.Generator().manual_seed(12)
    prompts = [torch.randint(3, 49152, (n,), generator=gen).tolist() for n in (6, 11)]
    params = {"max_new_tokens": 16, "temperature": 0, "ignore_eos": True}
    common = {"dtype": "float32", "tp_size": 2, "ep_size": 2, "num_threads": 1, "max_total_tokens": 1024,
              "max_running_requests": 4}
    port = free_port()
    flags = [f"--{k.replace('_', '-')}={v}" for k, v in common.items()]
    node1 = subprocess.Popen([sys.executable, "-m", "radixgen.serve", "--model-path", str(folder), "--node-rank", "1",
                              "--nnodes", "2", "--dist-init-addr", f"127.0.0.1:{port}", *flags])
    try:
        with Engine(model=str(folder), nnodes=2, dist_init_addr=f"127.0.0.1:{port}", **common) as e:
            info = e.get_server_info()["parallel"]
            assert (info["nnodes"], info["ep_size"], list(info["rank_pids"])) == (2, 2, ["0"])  # rank 1: node 1's
            got = [e.generate(input_ids=p, sampling_params=params)["output_ids"] for p in prompts]
        assert node1.wait(60) == 0  # the group's shutdown reached node 1
    finally:
        node1.kill()
    ref = tf.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        want = [ref.generate(torch.tensor([p]), max_new_tokens=16, min_new_tokens=16, do_sample=False)[0][len(p):]
                .tolist() for p in prompts]
    assert got == want
