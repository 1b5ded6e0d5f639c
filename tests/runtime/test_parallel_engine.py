"""The Engine with tensor / pipeline parallelism on the default model (SmolLM2-135M: 9 heads over 3 KV heads, so
tp 2 splits them 2 + 1), each rank a process with one thread:

- greedy outputs token for token identical to tp 1 (float32) for tp 2, pp 2, and tp 2 across two launches as
  "nodes" (node 1 a separate `radixgen serve --node-rank 1`, on loopback); in bfloat16 on the fused decode
  step, pipeline stages give the same tokens as one process;
- the radix cache: the same hits as tp 1 on a shared-prefix workload (KV slots are rank 0's, one table);
- pipeline micro-batches under pressure: retractions and aborts of requests in flight, same outputs as tp 1, no
  slot leaked;
- startup errors are clear and bounded: a taken port, a node started with another layout, a node that never
  comes.
"""

from __future__ import annotations

import socket
import subprocess
import sys

import pytest

from radixgen.runtime.engine import Engine
from radixgen.runtime.executor.distributed import GroupError

PROMPTS = ["The capital of France is", "Write a short poem about the sea.", "def fibonacci(n):",
           "List three colors:", "Once upon a time in a small village,"]
GREEDY = {"max_new_tokens": 32, "temperature": 0}
COMMON = {"num_threads": 1, "max_total_tokens": 4096, "max_running_requests": 16,
          "quantization": "none"}  # the dequantized default model: bf16 / float32 weights split by rank


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def outputs(engine: Engine, prompts=PROMPTS, params=GREEDY) -> list[list[int]]:
    return [r["output_ids"] for r in engine.generate(prompts, params)]


def node_command(port: int, *flags: str) -> list[str]:
    """`radixgen serve` for node 1 of a two-node group, one rank per node."""
    return [sys.executable, "-m", "radixgen.serve", "--node-rank", "1", "--nnodes", "2", "--dist-init-addr",
            f"127.0.0.1:{port}", "--num-threads", "1", "--max-total-tokens", "4096", "--max-running-requests", "16",
            "--quantization", COMMON["quantization"], *flags]


@pytest.fixture(scope="module")
def reference() -> list[list[int]]:
    with Engine(dtype="float32", **COMMON) as e:
        return outputs(e)


@pytest.mark.parametrize("layout", [{"tp_size": 2}, {"pp_size": 2}])
def test_greedy_outputs_identical_to_tp1(reference, layout):
    with Engine(dtype="float32", **COMMON, **layout) as e:
        assert e.get_server_info()["parallel"]["rank_pids"].keys() == {"0", "1"}
        assert outputs(e) == reference


def test_tp2_with_ngram_speculation_gives_the_same_tokens(reference):
    """Verification steps (several rows per request) reach every rank as such: the same tokens as tp 1."""
    with Engine(dtype="float32", tp_size=2, speculative_algorithm="ngram", **COMMON) as e:
        assert outputs(e) == reference
        spec = e.get_server_info()["speculative"]
    assert spec["draft_tokens"] > 0 and spec["accepted_tokens"] > 0


def test_tp2_across_two_nodes(reference):
    port = free_port()
    node1 = subprocess.Popen(node_command(port, "--tp-size", "2", "--dtype", "float32"))
    try:
        with Engine(dtype="float32", tp_size=2, nnodes=2, dist_init_addr=f"127.0.0.1:{port}", **COMMON) as e:
            info = e.get_server_info()["parallel"]
            assert (info["tp_size"], info["nnodes"], list(info["rank_pids"])) == (2, 2, ["0"])  # rank 1 is node 1's
            assert outputs(e) == reference
        assert node1.wait(60) == 0  # the group's shutdown reached node 1
    finally:
        node1.kill()


def test_pipeline_stages_on_the_fused_step_give_the_same_tokens():
    prompts, params = PROMPTS[:3], {"max_new_tokens": 24, "temperature": 0}
    with Engine(dtype="bfloat16", **COMMON) as e:  # one request at a time: the same batches in both
        want = [outputs(e, [p], params)[0] for p in prompts]
    with Engine(dtype="bfloat16", pp_size=2, **COMMON) as e:
        assert [outputs(e, [p], params)[0] for p in prompts] == want


def test_radix_cache_hits_identical_to_tp1():
    system = "You are a helpful assistant who answers in one short sentence. " * 3
    prompts = [system + q for q in ("What is the sun?", "What is the moon?", "What is a star?")]
    prompts += [prompts[0] + " And why?", system + "What is the sun? Tell me more."]
    seen = {}
    for layout in ({}, {"tp_size": 2}):
        with Engine(dtype="float32", **COMMON, **layout) as e:
            results = [e.generate(p, {"max_new_tokens": 8, "temperature": 0}) for p in prompts]  # one by one
            stats = e.get_server_info()["stats"]
            seen[str(layout)] = ([r["meta_info"]["cached_tokens"] for r in results], stats["cached_tokens"],
                                 [r["output_ids"] for r in results])
    one, two = seen.values()
    assert one == two
    assert min(one[0][1:]) > 20  # the shared system prompt was reused


def test_pipeline_under_pressure_retracts_and_aborts_without_leaks():
    prompts = [f"Question {i}: what is {i} plus {3 * i}? Answer:" for i in range(12)]
    params = {"max_new_tokens": 40, "temperature": 0, "ignore_eos": True}
    small = {**COMMON, "max_total_tokens": 400}  # too small for all at once: retractions
    with Engine(dtype="float32", **small) as e:
        want = outputs(e, prompts, params)
    with Engine(dtype="float32", pp_size=2, **small) as e:
        stream = e.generate("Count from one to a hundred:", {"max_new_tokens": 200, "ignore_eos": True},
                            stream=True, rid="to-abort")
        next(stream)
        e.abort("to-abort")  # in flight in a pipeline stage, or waiting: either way it ends
        list(stream)
        assert outputs(e, prompts, params) == want
        info = e.get_server_info()
        assert info["stats"]["retractions"] > 0
        assert info["invariant_ok"] is True


def test_port_taken():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        with pytest.raises(GroupError, match="port taken"):
            Engine(tp_size=2, dist_init_addr=f"127.0.0.1:{s.getsockname()[1]}", **COMMON)


def test_node_started_with_another_layout():
    port = free_port()
    node1 = subprocess.Popen(node_command(port, "--tp-size", "2", "--max-kv-memory-gb", "1"), stderr=subprocess.PIPE)
    try:
        with pytest.raises(RuntimeError, match=r"another layout than node 0: config\.max_kv_memory_gb=1\.0"):
            Engine(tp_size=2, nnodes=2, dist_init_addr=f"127.0.0.1:{port}", **COMMON)
        assert node1.wait(60) == 1
        assert b"another layout" in node1.stderr.read()
    finally:
        node1.kill()


def test_node_that_never_joins():
    with pytest.raises(RuntimeError, match=r"ranks \[1\] \(node\(s\) \[1\]\) did not join"):
        Engine(tp_size=2, nnodes=2, dist_init_addr=f"127.0.0.1:{free_port()}", dist_timeout=5, **COMMON)
