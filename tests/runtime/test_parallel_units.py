"""Tensor / pipeline parallelism without processes: the sharding arithmetic, the step description on the wire, the
table-write log, the options and their checks, the group's layout check."""

from __future__ import annotations

import pytest
import torch

from radixgen.runtime.config import ModelConfig, RuntimeConfig
from radixgen.runtime.executor import distributed
from radixgen.runtime.executor.step_messages import ForwardInput, StepDescription, StepKind
from radixgen.runtime.ground.kv_pool import ReqToSlotTable, TableWriteLog, new_req_to_slot_table
from radixgen.runtime.ground.sharding import HeadShard, head_shard, layer_range, split_range, vocab_shard
from radixgen.runtime.rank_args import node_ranks, rank_threads


def test_split_range_covers_everything_once_in_order():
    for n in (0, 1, 5, 9, 129, 1536):
        for parts in (1, 2, 3, 4, 7):
            pieces = [split_range(n, parts, i) for i in range(parts)]
            assert sum(size for _, size in pieces) == n
            assert max(size for _, size in pieces) - min(size for _, size in pieces) <= 1
            start = 0
            for s, size in pieces:
                assert s == start
                start += size
    assert split_range(129, 2, 0) == (0, 65) and split_range(129, 2, 1) == (65, 64)


def test_head_shards():
    # SmolLM2's 9 heads over 3 KV heads at tp 2: KV heads 2 + 1, each with its 3 query heads
    assert [head_shard(9, 3, 2, r) for r in range(2)] == [HeadShard(0, 6, 0, 2), HeadShard(6, 3, 2, 1)]
    # fewer KV heads than ranks: each KV head replicated, its query heads split between the ranks sharing it
    assert [head_shard(8, 2, 4, r) for r in range(4)] == [HeadShard(0, 2, 0, 1), HeadShard(2, 2, 0, 1),
                                                          HeadShard(4, 2, 1, 1), HeadShard(6, 2, 1, 1)]
    assert [head_shard(2, 1, 2, r) for r in range(2)] == [HeadShard(0, 1, 0, 1), HeadShard(1, 1, 0, 1)]
    assert head_shard(4, 2, 1, 0) == HeadShard(0, 4, 0, 2)
    for tp in (1, 2, 3, 4, 6):  # every query head exactly once, each rank reading the KV head of its queries
        shards = [head_shard(12, 6 if tp <= 6 else 2, tp, r) for r in range(tp)]
        assert sorted(q for s in shards for q in range(s.q_start, s.q_start + s.num_heads)) == list(range(12))
        for s in shards:
            assert s.kv_start == s.q_start // 2 and s.num_heads == 2 * s.num_kv_heads
    with pytest.raises(ValueError, match="multiple of num_key_value_heads"):
        head_shard(6, 2, 3, 0)
    with pytest.raises(ValueError, match="exceeds num_attention_heads"):
        head_shard(2, 1, 4, 0)


def test_vocab_shards_pad_to_equal_pieces():
    assert vocab_shard(49152, 2, 1) == (24576, 24576, 24576)
    assert [vocab_shard(49153, 2, r) for r in range(2)] == [(0, 24577, 24577), (24577, 24577, 24576)]
    assert [vocab_shard(10, 4, r) for r in range(4)] == [(0, 3, 3), (3, 3, 3), (6, 3, 3), (9, 3, 1)]
    assert vocab_shard(2, 4, 3) == (2, 1, 0)  # a rank past the vocabulary holds padding only


def test_layer_ranges():
    assert [layer_range(30, 4, s) for s in range(4)] == [(0, 8), (8, 16), (16, 23), (23, 30)]
    with pytest.raises(ValueError, match="exceeds the model's 2 layers"):
        layer_range(2, 3, 2)


def test_step_description_round_trip():
    fi = ForwardInput(torch.tensor([5, 6, 7, 8]), torch.tensor([0, 1, 2, 9]), torch.tensor([11, 12, 13, 14]),
                      torch.tensor([3, 0]), [0, 9], [3, 1], torch.tensor([2, 3]))
    log = TableWriteLog()
    table = new_req_to_slot_table(4, 16)
    log.record(table, 3, 0, torch.tensor([11, 12, 13]))
    log.record_cells(torch.tensor([0]), torch.tensor([9]), torch.tensor([14]))
    desc = StepDescription(StepKind.FORWARD, fi, log.take())
    header, payload = desc.pack()
    assert header.shape == (StepDescription.HEADER_LEN,) and payload.numel() == StepDescription.payload_len(header)
    back = StepDescription.unpack(header, payload)
    assert back.kind == StepKind.FORWARD
    for a, b in zip(back.forward_input, fi, strict=True):
        assert (a == b).all() if isinstance(a, torch.Tensor) else a == b
    for a, b in zip(back.table_writes, desc.table_writes, strict=True):
        assert torch.equal(a, b)
    for kind in (StepKind.HEARTBEAT, StepKind.SHUTDOWN):
        header, payload = StepDescription(kind).pack()
        assert payload.numel() == 0 == StepDescription.payload_len(header)
        assert StepDescription.unpack(header, payload).kind == kind


def test_table_write_log_replays_the_writes_and_logs_only_changes():
    table, copy = new_req_to_slot_table(4, 32), new_req_to_slot_table(4, 32)
    log = TableWriteLog()
    rows = ReqToSlotTable(table, log)
    gen = torch.Generator().manual_seed(0)
    for _ in range(3):
        for _ in range(5):
            row, start = int(torch.randint(0, 4, (1,), generator=gen)), int(torch.randint(0, 20, (1,), generator=gen))
            rows.write(row, start, torch.randint(1, 500, (int(torch.randint(1, 12, (1,), generator=gen)),),
                                                 generator=gen))
        rows.write_cells(torch.tensor([0, 2]), torch.tensor([30, 31]), torch.tensor([7, 8]))
        log.take().apply(copy)
        assert torch.equal(table, copy)
    rows.write(1, 0, table[1, :20].clone())  # rewriting what is there (caching a computed prefix)
    assert log.take().slots.numel() == 0
    changed = table[2, :10].clone()
    changed[4] = 999
    rows.write(2, 0, changed)
    writes = log.take()
    assert writes.starts.tolist() == [4] and writes.lengths.tolist() == [1] and writes.slots.tolist() == [999]


def test_parallel_options_and_checks():
    cfg = RuntimeConfig.from_kwargs(tensor_parallel_size=2, pipeline_parallel_size=2)
    assert (cfg.tp_size, cfg.pp_size, cfg.world_size) == (2, 2, 4)
    with pytest.raises(ValueError, match="not both"):
        RuntimeConfig.from_kwargs(tp_size=2, tensor_parallel_size=2)
    for kw, match in [({"tp_size": 0}, "tp_size must be >= 1"),
                      ({"nnodes": 2, "tp_size": 2}, "dist_init_addr"),
                      ({"nnodes": 2, "tp_size": 3, "dist_init_addr": "h:1"}, "do not split evenly"),
                      ({"node_rank": 1}, "node_rank must be in"),
                      ({"dist_init_addr": "localhost"}, "host:port"),
                      ({"dist_init_addr": "h:70000"}, "host:port"),
                      ({"dist_timeout": 0}, "dist_timeout")]:
        with pytest.raises(ValueError, match=match):
            RuntimeConfig(**kw)
    cfg = RuntimeConfig(tp_size=2, pp_size=2, nnodes=2, node_rank=1, dist_init_addr="10.0.0.1:5000")
    assert list(node_ranks(cfg)) == [2, 3]
    assert rank_threads(cfg) >= 1 and rank_threads(RuntimeConfig(tp_size=2, num_threads=3)) == 3


def test_serve_flags_of_the_parallel_options():
    import argparse

    from radixgen.runtime.server.launch import add_server_args, server_args_from

    parser = argparse.ArgumentParser()
    add_server_args(parser)
    args = server_args_from(parser.parse_args(["--tensor-parallel-size", "2", "--pp-size", "2", "--nnodes", "2",
                                               "--node-rank", "1", "--dist-init-addr", "127.0.0.1:29500"]))
    assert args.engine == {"tp_size": 2, "pp_size": 2, "nnodes": 2, "node_rank": 1,
                           "dist_init_addr": "127.0.0.1:29500"}
    with pytest.raises(ValueError, match="dp_size > 1"):
        server_args_from(parser.parse_args(["--dp-size", "2", "--tp-size", "2", "--nnodes", "2",
                                            "--dist-init-addr", "127.0.0.1:29500"]))


def test_layout_fingerprint_names_the_difference():
    mc = ModelConfig("llama", 100, 64, 128, 2, 4, 2, 16, 1e-5, 1e4, 128, False)
    a = distributed.fingerprint(RuntimeConfig(tp_size=2), mc)
    b = distributed.fingerprint(RuntimeConfig(tp_size=2, max_running_requests=64, num_threads=3), mc)
    assert a != b
    import json

    diff = distributed._differences(json.loads(a), json.loads(b))
    assert diff == "config.max_running_requests=64 (node 0: 128)"  # threads may differ between nodes


def test_lora_with_parallelism_is_refused_at_start_naming_the_sizes():
    """The adapter pool, its loads and each step's adapter rows live on one rank: an Engine, the offline LLM or
    a config asking for LoRA with tp or pp above 1 fails before any process starts, naming both."""
    from radixgen.offline import LLM
    from radixgen.runtime.engine import Engine

    match = r"LoRA adapters .* not supported with tensor or pipeline parallelism \(tp_size=2, pp_size=1\)"
    with pytest.raises(ValueError, match=match):
        Engine(enable_lora=True, tp_size=2)
    with pytest.raises(ValueError, match=match):
        LLM(enable_lora=True, tensor_parallel_size=2)
    with pytest.raises(ValueError, match=r"\(tp_size=1, pp_size=2\)"):
        RuntimeConfig(lora_paths=("a=/x",), pp_size=2)
    assert RuntimeConfig(enable_lora=True).lora_enabled and RuntimeConfig(tp_size=2).world_size == 2
