"""Logits processors: in-place edits of a (B, V) float32 logits tensor before sampling. Penalties (sparse over
the (row, token) pairs they touch), vocabulary masks, and the sanitizing that keeps hostile values (NaN, inf,
overflowing penalties) from reaching the sampler's arithmetic."""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Sequence
from typing import NamedTuple

import torch
from torch import Tensor

from radixgen.common.sampling_params import SamplingParams

_FLOAT_MAX = torch.finfo(torch.float32).max
LOGPROB_FLOOR = -_FLOAT_MAX  # the logprob of an impossible token (-inf), as a finite number


class TokenAdjust(NamedTuple):
    """One entry per distinct (batch row, token id) pair."""

    rows: Tensor  # (N,) int64
    ids: Tensor  # (N,) int64
    values: Tensor  # (N,) float32


class Penalties(NamedTuple):
    """Sparse: only the (row, token) pairs a penalty touches, so a step pays O(tokens), not O(B * V)."""

    repetition: TokenAdjust | None  # values: the row's repetition penalty, over prompt + output tokens
    additive: TokenAdjust | None  # values: frequency_penalty * count + presence_penalty, over output tokens
    bias: TokenAdjust | None = None  # values: the row's logit_bias of each token it names


def _distinct_pairs(rows: list[int], tokens: list[Iterable[int]], vocab_size: int,
                    what: str) -> tuple[Tensor, Tensor, Tensor]:
    """Distinct (row, token) pairs of `tokens[j]` under batch row `rows[j]`, with their counts: (N,) each."""
    flat = [list(t) for t in tokens]
    lengths = torch.tensor([len(t) for t in flat], dtype=torch.int64)
    row = torch.repeat_interleave(torch.tensor(rows, dtype=torch.int64), lengths)
    tok = torch.tensor(list(itertools.chain.from_iterable(flat)), dtype=torch.int64)
    if tok.numel() and (int(tok.min()) < 0 or int(tok.max()) >= vocab_size):
        raise ValueError(f"{what}: token ids must be in [0, {vocab_size}), "
                         f"got [{int(tok.min())}, {int(tok.max())}]")
    keys, counts = torch.unique(row * vocab_size + tok, return_counts=True)
    return keys // vocab_size, keys % vocab_size, counts


def build_penalties(params: Sequence[SamplingParams], output_ids: Sequence[Sequence[int]],
                     prompt_ids: Sequence[Sequence[int]], vocab_size: int,
                     device: torch.device) -> Penalties | None:
    additive = repetition = None
    add_rows = [i for i, p in enumerate(params) if p.frequency_penalty != 0.0 or p.presence_penalty != 0.0]
    if add_rows:
        outputs = [output_ids[i] for i in add_rows]
        row, tok, count = _distinct_pairs(add_rows, outputs, vocab_size, "output_ids")
        freq = torch.tensor([p.frequency_penalty for p in params], dtype=torch.float32)[row]
        pres = torch.tensor([p.presence_penalty for p in params], dtype=torch.float32)[row]
        additive = TokenAdjust(row.to(device), tok.to(device), (freq * count.float() + pres).to(device))
    rep_rows = [i for i, p in enumerate(params) if p.repetition_penalty != 1.0]
    if rep_rows:
        seen = [itertools.chain(prompt_ids[i], output_ids[i]) for i in rep_rows]
        row, tok, _ = _distinct_pairs(rep_rows, seen, vocab_size, "prompt_ids + output_ids")
        rep = torch.tensor([p.repetition_penalty for p in params], dtype=torch.float32)[row]
        repetition = TokenAdjust(row.to(device), tok.to(device), rep.to(device))
    bias = None
    bias_rows = [i for i, p in enumerate(params) if p.logit_bias]
    if bias_rows:
        pairs = [(i, tok, b) for i in bias_rows for tok, b in params[i].logit_bias.items()]
        row, tok, val = (torch.tensor(col, dtype=dt) for col, dt in
                         zip(zip(*pairs, strict=True), (torch.int64, torch.int64, torch.float32), strict=True))
        if int(tok.max()) >= vocab_size:
            raise ValueError(f"logit_bias: token ids must be in [0, {vocab_size}), got {int(tok.max())}")
        bias = TokenAdjust(row.to(device), tok.to(device), val.to(device))
    if additive is None and repetition is None and bias is None:
        return None
    return Penalties(repetition, additive, bias)


def apply_penalties(logits: Tensor, penalties: Penalties) -> None:
    """In place on (B, V) logits. Repetition first (HF: a seen token's positive logit is divided by the
    penalty, a negative one multiplied), then OpenAI's: logit -= frequency * count + presence * (count > 0)
    with counts over the output tokens, then logit_bias. A finite logit stays finite (an overflow saturates),
    -inf stays -inf."""
    if penalties.repetition is not None:
        row, tok, rep = penalties.repetition
        v = logits[row, tok]  # (N,)
        logits[row, tok] = saturate(torch.where(v > 0, v / rep, v * rep))
    if penalties.additive is not None:
        row, tok, amount = penalties.additive
        logits[row, tok] = saturate(logits[row, tok] - amount)  # pairs are distinct: no accumulation needed
    if penalties.bias is not None:  # after the penalties, as OpenAI adds logit_bias to the final logits
        row, tok, amount = penalties.bias
        logits[row, tok] = saturate(logits[row, tok] + amount)  # a dict's keys are distinct


def saturate(x: Tensor) -> Tensor:
    """NaN -> -inf, +inf -> the largest float32, -inf kept: in place, returns `x`."""
    return x.nan_to_num_(nan=float("-inf"), posinf=_FLOAT_MAX, neginf=float("-inf"))


def finite_logprobs(x: Tensor) -> Tensor:
    """-inf / NaN logprobs (impossible tokens, rows with no finite logit) -> LOGPROB_FLOOR, in place."""
    return x.nan_to_num_(nan=LOGPROB_FLOOR, posinf=0.0, neginf=LOGPROB_FLOOR)


def apply_vocab_mask(logits: Tensor, mask: Tensor) -> None:
    """Disallowed tokens get -inf, in place. `mask` is (B, >= V') bool with True = allowed, or an int32
    bitmask (B, ceil(V'/32)) where bit b of word w allows token 32 * w + b (xgrammar's layout).
    Columns the mask does not cover are disallowed."""
    if mask.dim() != 2 or mask.shape[0] != logits.shape[0]:
        raise ValueError(f"vocab_mask: expected ({logits.shape[0]}, ...) rows, got shape {tuple(mask.shape)}")
    if mask.dtype == torch.int32:
        bits = torch.arange(32, dtype=torch.int32, device=mask.device)
        mask = ((mask.unsqueeze(-1) >> bits) & 1).bool().flatten(1)  # (B, 32 * words)
    elif mask.dtype != torch.bool:
        raise ValueError(f"vocab_mask: dtype must be bool (True = allowed) or int32 (packed bitmask), "
                         f"got {mask.dtype}")
    width = min(mask.shape[1], logits.shape[1])
    logits[:, :width].masked_fill_(~mask[:, :width].to(logits.device), float("-inf"))
    logits[:, width:] = float("-inf")
