"""Logprobs of a prompt's own tokens (and the best alternatives), for `select` scoring and prompt logprobs: the
prefill's logits row by row, in chunks so that a long prompt never holds a (T, V) float32 copy."""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from radixgen.runtime.executor.logits_processors import finite_logprobs, saturate
from radixgen.runtime.executor.sampler import TopK

CHUNK_ELEMENTS = 1 << 24  # logits worked on at a time


class PromptLogprobs(NamedTuple):
    logprobs: Tensor  # (T,) float32
    top: TopK | None


def prompt_logprobs(logits: Tensor, target_ids: Tensor, top_k: int = 0,
                    vocab_size: int | None = None) -> PromptLogprobs:
    """Logprob of each target under its row of `logits` (T, V): row t holds the prediction after prompt
    position t, so `target_ids[t]` is prompt token t + 1. With `top_k` > 0 also the k best alternatives
    per row. Computed in float32 over the first `vocab_size` columns (all when None)."""
    if logits.dim() != 2:
        raise ValueError(f"prompt_logprobs: logits must be (T, V), got shape {tuple(logits.shape)}")
    t, width = logits.shape
    vocab = width if vocab_size is None else vocab_size
    if not 0 < vocab <= width:
        raise ValueError(f"prompt_logprobs: vocab_size must be in [1, {width}], got {vocab_size}")
    if target_ids.shape != (t,):
        raise ValueError(f"prompt_logprobs: target_ids must be ({t},), got shape {tuple(target_ids.shape)}")
    if t and (int(target_ids.min()) < 0 or int(target_ids.max()) >= vocab):
        raise ValueError(f"prompt_logprobs: target_ids must be in [0, {vocab})")
    if not 0 <= top_k <= vocab:
        raise ValueError(f"prompt_logprobs: top_k must be in [0, {vocab}], got {top_k}")
    logits = logits[:, :vocab]
    targets = target_ids.to(device=logits.device, dtype=torch.int64)
    out = torch.empty(t, dtype=torch.float32, device=logits.device)
    top = TopK(torch.empty(t, top_k, dtype=torch.float32, device=logits.device),
               torch.empty(t, top_k, dtype=torch.int64, device=logits.device)) if top_k else None
    chunk = max(1, CHUNK_ELEMENTS // vocab)
    for start in range(0, t, chunk):
        end = min(start + chunk, t)
        rows = logits[start:end]  # (chunk, vocab)
        if not bool(torch.isfinite(rows.amax(dim=-1)).all()):  # a NaN / inf logit: sanitize a copy
            rows = saturate(rows.to(torch.float32, copy=True))
        lp = torch.log_softmax(rows, dim=-1, dtype=torch.float32)
        out[start:end] = finite_logprobs(lp.gather(1, targets[start:end].unsqueeze(1)).squeeze(1))
        if top is not None:
            values, ids = lp.topk(top_k, dim=-1)
            top.values[start:end] = finite_logprobs(values)
            top.ids[start:end] = ids
    return PromptLogprobs(out, top)
