"""The sharding arithmetic of tensor and pipeline parallelism, as pure functions of the sizes: which attention
heads, vocabulary rows, MLP columns and decoder layers a rank holds. Every rank computes every rank's share the
same way, so no rank needs to ask another."""

from __future__ import annotations

from typing import NamedTuple


def split_range(n: int, parts: int, index: int) -> tuple[int, int]:
    """Part `index` of [0, n) cut into `parts` contiguous pieces as equal as possible (the first n % parts get
    one more): (start, size)."""
    base, extra = divmod(n, parts)
    return index * base + min(index, extra), base + (1 if index < extra else 0)


class HeadShard(NamedTuple):
    """A tensor-parallel rank's attention heads: query heads [q_start, q_start + num_heads) and KV heads
    [kv_start, kv_start + num_kv_heads), the KV heads its query heads read."""

    q_start: int
    num_heads: int
    kv_start: int
    num_kv_heads: int


def head_shard(num_heads: int, num_kv_heads: int, tp_size: int, tp_rank: int) -> HeadShard:
    """With at least as many KV heads as ranks, the KV heads are split (unevenly when they must be: 3 over 2
    ranks is 2 + 1) and each rank takes the query heads of its KV heads. With fewer, each KV head is
    replicated on tp_size / num_kv_heads ranks, which split its query heads between them."""
    group = num_heads // num_kv_heads  # query heads per KV head
    if num_kv_heads >= tp_size:
        kv_start, kv_n = split_range(num_kv_heads, tp_size, tp_rank)
        return HeadShard(kv_start * group, kv_n * group, kv_start, kv_n)
    if tp_size % num_kv_heads:
        raise ValueError(f"tp_size={tp_size} must be a multiple of num_key_value_heads={num_kv_heads} when it "
                         f"is larger (each KV head is replicated on the same number of ranks)")
    sharing = tp_size // num_kv_heads  # ranks holding one KV head
    if group < sharing:
        raise ValueError(f"tp_size={tp_size} exceeds num_attention_heads={num_heads}: a rank would hold no "
                         f"query head")
    kv = tp_rank // sharing
    q_start, q_n = split_range(group, sharing, tp_rank % sharing)
    return HeadShard(kv * group + q_start, q_n, kv, 1)


def vocab_shard(vocab_size: int, tp_size: int, tp_rank: int) -> tuple[int, int, int]:
    """(start, rows, valid): a rank's rows of the vocabulary-parallel embedding and LM head. Every rank holds
    `rows` = ceil(vocab / tp) rows so that gathered logits are equal pieces; rows past the vocabulary (the
    last ranks' `rows - valid`) are zero padding and cut off after the gather."""
    rows = -(-vocab_size // tp_size)
    start = min(tp_rank * rows, vocab_size)
    return start, rows, min(rows, vocab_size - start)


def layer_range(num_layers: int, pp_size: int, pp_rank: int) -> tuple[int, int]:
    """The decoder layers [start, end) of pipeline stage `pp_rank`."""
    start, n = split_range(num_layers, pp_size, pp_rank)
    if n == 0:
        raise ValueError(f"pp_size={pp_size} exceeds the model's {num_layers} layers: a stage would hold none")
    return start, start + n
