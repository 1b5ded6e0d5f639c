"""Logits -> token ids: penalties, constraint masks, temperature / top-k / top-p / min-p, logprobs.

The scheduler builds one `SamplingBatch` per step from the requests' `SamplingParams` and calls
`Sampler.forward` once with every row of that step. Work that no row of the batch asks for (penalties,
truncation, per-request generators, logprobs) is skipped entirely.

Sampling is inverse-CDF over the kept tokens taken in vocabulary order, driven by one uniform number per
row. A seeded request draws its number from its own generator, so its tokens depend neither on the
other rows of the batch nor on its row position.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import NamedTuple

import torch
from radixgen.runtime.sampling_params import SamplingParams
from torch import Tensor

# top-k / top-p / min-p cutoffs are first looked for among the most probable tokens only: a full sort of
# (64, 49152) costs ~400 ms on two CPU cores, a top-512 ~30 ms; rows whose cutoff lies deeper are sorted.
DEFAULT_CANDIDATES = 512
# prompt_logprobs works on this many logits at a time, so a long prompt never holds a (T, V) float copy.
_PROMPT_CHUNK_ELEMENTS = 1 << 24


def make_generator(seed: int) -> torch.Generator:
    """The generator of a seeded request: made once when the request starts, passed at every step."""
    if not isinstance(seed, int) or isinstance(seed, bool):
        raise ValueError(f"seed must be an integer, got {seed!r}")
    g = torch.Generator(device="cpu")
    try:
        g.manual_seed(seed)
    except RuntimeError as e:
        raise ValueError(f"seed {seed} is out of range: {e}") from e
    return g


class Penalties(NamedTuple):
    """Penalty inputs for the rows that have any penalty; the other rows are left untouched."""

    rows: Tensor | None  # (P,) int64 rows of the batch; None: every row
    frequency: Tensor  # (P, 1) float32
    presence: Tensor  # (P, 1)
    repetition: Tensor  # (P, 1)
    counts: Tensor | None  # (P, vocab) float32 output-token counts; None when no frequency/presence penalty
    seen: Tensor | None  # (P, vocab) bool, token in prompt or output; None when no repetition penalty


class TopLogprobs(NamedTuple):
    logprobs: list[float]  # descending
    token_ids: list[int]


class SampleOutput(NamedTuple):
    next_ids: Tensor  # (B,) int64
    logprobs: Tensor | None  # (B,) float32 logprob of next_ids under the raw logits
    top_logprobs: list[TopLogprobs] | None  # one per row (empty where 0 were asked)


class TopK(NamedTuple):
    values: Tensor  # (T, k) float32, descending
    ids: Tensor  # (T, k) int64


class PromptLogprobs(NamedTuple):
    logprobs: Tensor  # (T,) float32
    top: TopK | None


def _ids_tensor(rows: Sequence[Sequence[int]], vocab_size: int, what: str) -> tuple[Tensor, Tensor]:
    """(row index, token id) pairs of a ragged list of token lists, as two (N,) int64 tensors."""
    lengths = torch.tensor([len(r) for r in rows], dtype=torch.int64)
    row_idx = torch.repeat_interleave(torch.arange(len(rows)), lengths)
    tok = torch.tensor(list(itertools.chain.from_iterable(rows)), dtype=torch.int64)
    if tok.numel() and (int(tok.min()) < 0 or int(tok.max()) >= vocab_size):
        raise ValueError(f"{what}: token ids must be in [0, {vocab_size}), "
                         f"got [{int(tok.min())}, {int(tok.max())}]")
    return row_idx, tok


def _build_penalties(params: Sequence[SamplingParams], output_ids: Sequence[Sequence[int]],
                     prompt_ids: Sequence[Sequence[int]], vocab_size: int,
                     device: torch.device) -> Penalties | None:
    rows = [i for i, p in enumerate(params)
            if p.frequency_penalty != 0.0 or p.presence_penalty != 0.0 or p.repetition_penalty != 1.0]
    if not rows:
        return None
    sel = [params[i] for i in rows]

    def column(name: str) -> Tensor:
        return torch.tensor([getattr(p, name) for p in sel], dtype=torch.float32, device=device).unsqueeze(1)

    counts = seen = None
    if any(p.frequency_penalty != 0.0 or p.presence_penalty != 0.0 for p in sel):
        r, t = _ids_tensor([output_ids[i] for i in rows], vocab_size, "output_ids")
        counts = torch.zeros(len(rows), vocab_size, dtype=torch.float32, device=device)
        counts.index_put_((r.to(device), t.to(device)), torch.ones(t.numel(), device=device), accumulate=True)
    if any(p.repetition_penalty != 1.0 for p in sel):
        r, t = _ids_tensor([list(prompt_ids[i]) + list(output_ids[i]) for i in rows], vocab_size,
                           "prompt_ids/output_ids")
        seen = torch.zeros(len(rows), vocab_size, dtype=torch.bool, device=device)
        seen[r.to(device), t.to(device)] = True
    row_t = None if len(rows) == len(params) else torch.tensor(rows, dtype=torch.int64, device=device)
    return Penalties(row_t, column("frequency_penalty"), column("presence_penalty"),
                     column("repetition_penalty"), counts, seen)


def apply_penalties(logits: Tensor, penalties: Penalties) -> None:
    """In place on (B, V) logits, over the first `vocab` columns of the penalized rows.

    Repetition first (HF: a seen token's positive logit is divided by the penalty, a negative one
    multiplied), then OpenAI's: logit -= frequency * count + presence * (count > 0), over output tokens.
    """
    width = (penalties.counts if penalties.counts is not None else penalties.seen).shape[1]
    view = logits[:, :width]
    sub = view if penalties.rows is None else view[penalties.rows]  # (P, vocab)
    if penalties.seen is not None:
        rep = penalties.repetition
        sub = torch.where(penalties.seen, torch.where(sub > 0, sub / rep, sub * rep), sub)
    if penalties.counts is not None:
        counts = penalties.counts
        sub = sub - (penalties.frequency * counts + penalties.presence * (counts > 0))
    if penalties.rows is None:
        view.copy_(sub)
    else:
        view[penalties.rows] = sub


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


@dataclass(frozen=True)
class SamplingBatch:
    """Per-step sampling inputs. Rows split into greedy rows (argmax) and sampled rows; the per-row
    tensors below cover the sampled rows only, and a truncation tensor is None when no sampled row
    uses it."""

    batch_size: int
    vocab_size: int
    greedy_rows: Tensor  # (G,) int64
    sample_rows: Tensor  # (S,) int64
    temperatures: Tensor | None  # (S, 1) float32; None when S == 0
    top_ks: Tensor | None  # (S,) int64, vocab_size where disabled
    top_ps: Tensor | None  # (S,) float32, 1.0 where disabled
    min_ps: Tensor | None  # (S,) float32, 0.0 where disabled
    seeded: tuple[tuple[int, torch.Generator], ...]  # (index among the sampled rows, its generator)
    penalties: Penalties | None

    @property
    def is_all_greedy(self) -> bool:
        return self.sample_rows.numel() == 0

    @property
    def has_greedy(self) -> bool:
        return self.greedy_rows.numel() > 0

    @property
    def need_top_k(self) -> bool:
        return self.top_ks is not None

    @property
    def need_top_p(self) -> bool:
        return self.top_ps is not None

    @property
    def need_min_p(self) -> bool:
        return self.min_ps is not None

    @property
    def need_truncation(self) -> bool:
        return self.need_top_k or self.need_top_p or self.need_min_p

    @property
    def need_penalties(self) -> bool:
        return self.penalties is not None

    @classmethod
    def build(cls, params: Sequence[SamplingParams], output_ids: Sequence[Sequence[int]],
              prompt_ids: Sequence[Sequence[int]], generators: Sequence[torch.Generator | None],
              vocab_size: int, device: str | torch.device = "cpu") -> SamplingBatch:
        """One row per request. `output_ids` feed frequency/presence penalties, `prompt_ids` + `output_ids`
        the repetition penalty (read only for rows that have one). `generators[i]` is the request's
        `make_generator(seed)` generator, required when its params have a seed."""
        n = len(params)
        for name, seq in (("output_ids", output_ids), ("prompt_ids", prompt_ids), ("generators", generators)):
            if len(seq) != n:
                raise ValueError(f"SamplingBatch.build: {name} has {len(seq)} rows, params has {n}")
        if vocab_size <= 0:
            raise ValueError(f"SamplingBatch.build: vocab_size must be positive, got {vocab_size}")
        for i, (p, g) in enumerate(zip(params, generators, strict=True)):
            if p.seed is not None and g is None:
                raise ValueError(f"SamplingBatch.build: row {i} has seed={p.seed} but no generator")
        device = torch.device(device)
        greedy = [i for i, p in enumerate(params) if p.greedy]
        sampled = [i for i, p in enumerate(params) if not p.greedy]
        sp = [params[i] for i in sampled]

        def col(values: list, dtype: torch.dtype) -> Tensor:
            return torch.tensor(values, dtype=dtype, device=device)

        top_ks = top_ps = min_ps = temps = None
        if sp:
            temps = col([p.temperature for p in sp], torch.float32).unsqueeze(1)
            ks = [min(p.top_k, vocab_size) if p.top_k > 0 else vocab_size for p in sp]
            if any(k < vocab_size for k in ks):
                top_ks = col(ks, torch.int64)
            if any(p.top_p < 1.0 for p in sp):
                top_ps = col([p.top_p for p in sp], torch.float32)
            if any(p.min_p > 0.0 for p in sp):
                min_ps = col([p.min_p for p in sp], torch.float32)
        seeded = tuple((j, generators[i]) for j, i in enumerate(sampled) if generators[i] is not None)
        return cls(
            batch_size=n,
            vocab_size=vocab_size,
            greedy_rows=col(greedy, torch.int64),
            sample_rows=col(sampled, torch.int64),
            temperatures=temps,
            top_ks=top_ks,
            top_ps=top_ps,
            min_ps=min_ps,
            seeded=seeded,
            penalties=_build_penalties(params, output_ids, prompt_ids, vocab_size, device),
        )


def _cutoffs(sorted_p: Tensor, top_ks: Tensor | None, top_ps: Tensor | None, min_ps: Tensor | None,
             vocab: int, covers_all: bool) -> tuple[Tensor, Tensor]:
    """Per-row probability cutoff from the descending prefix `sorted_p` (S, K): tokens with p >= cutoff
    are kept. `complete` is False where the prefix is too short to decide (only when not `covers_all`).

    Top-k keeps the k most probable; top-p then keeps the smallest prefix whose probability,
    renormalized over the top-k survivors, reaches top_p; min-p drops p < min_p * max p. Ties with the
    cutoff value are kept."""
    s, k_len = sorted_p.shape
    cutoff = torch.zeros(s, dtype=sorted_p.dtype, device=sorted_p.device)
    complete = torch.ones(s, dtype=torch.bool, device=sorted_p.device)
    limited = None
    if top_ks is not None:
        k = top_ks
        limited = k < vocab
        in_prefix = k <= k_len
        kth = sorted_p.gather(1, (k.clamp(max=k_len) - 1).unsqueeze(1)).squeeze(1)
        cutoff = torch.where(limited & in_prefix, kth, cutoff)
        complete &= ~limited | in_prefix
    if top_ps is not None:
        csum = sorted_p.cumsum(-1)  # (S, K)
        total = torch.ones_like(cutoff)
        if limited is not None:
            kept_mass = csum.gather(1, (top_ks.clamp(max=k_len) - 1).unsqueeze(1)).squeeze(1)
            total = torch.where(limited, kept_mass, total)
        active = top_ps < 1.0
        reached = csum >= (top_ps * total).unsqueeze(1)
        found = reached.any(-1)
        first = reached.to(torch.uint8).argmax(-1)  # argmax returns the first maximal index
        at_first = sorted_p.gather(1, first.unsqueeze(1)).squeeze(1)
        cutoff = torch.where(active & found, torch.maximum(cutoff, at_first), cutoff)
        if not covers_all:  # a full sort that never reaches top_p (rounding) keeps everything
            complete &= ~active | found
    if min_ps is not None:
        cutoff = torch.maximum(cutoff, min_ps * sorted_p[:, 0])
    return cutoff, complete


def _inverse_cdf(probs: Tensor, u: Tensor) -> Tensor:
    """Index i with cdf[i - 1] <= u * total < cdf[i] per row of (n, L) non-negative `probs`; never a zero."""
    cdf = probs.cumsum(-1)  # (n, L)
    total = cdf[:, -1:]
    v = torch.minimum(u.unsqueeze(1) * total, torch.nextafter(total, torch.zeros_like(total)))
    return torch.searchsorted(cdf, v, right=True).squeeze(1)


class Sampler:
    """`candidates`: how many of the most probable tokens are searched for a truncation cutoff before
    falling back to a full sort of that row (the result does not depend on it, only the speed)."""

    def __init__(self, candidates: int = DEFAULT_CANDIDATES) -> None:
        if candidates < 1:
            raise ValueError(f"Sampler: candidates must be >= 1, got {candidates}")
        self.candidates = candidates

    def forward(self, logits: Tensor, batch: SamplingBatch, vocab_mask: Tensor | None = None,
                apply_mask: Callable[[Tensor], None] | None = None, return_logprob: bool = False,
                top_logprobs_num: int | Sequence[int] = 0) -> SampleOutput:
        """`logits` (B, V >= vocab_size) float32 is used as scratch and modified in place.

        Order: columns >= vocab_size -> -inf; penalties; `vocab_mask`, then `apply_mask(logits)` (the
        grammar's in-place mask); greedy rows take the argmax; sampled rows: temperature, top-k, top-p,
        min-p, sample. Logprobs are those of the raw logits (before penalties, masks and temperature)."""
        b, width = self._check(logits, batch)
        top_nums = self._top_nums(top_logprobs_num, b, batch.vocab_size)
        if width > batch.vocab_size:
            logits[:, batch.vocab_size:] = float("-inf")
        raw = None
        if return_logprob or max(top_nums, default=0) > 0:
            raw = torch.log_softmax(logits, dim=-1)  # (B, V), before anything below modifies logits
        if batch.penalties is not None:
            apply_penalties(logits, batch.penalties)
        if vocab_mask is not None:
            apply_vocab_mask(logits, vocab_mask)
        if apply_mask is not None:
            apply_mask(logits)
        if b:
            dead = torch.isneginf(logits.amax(dim=-1))
            if bool(dead.any()):
                rows = dead.nonzero().flatten().tolist()
                raise ValueError(f"Sampler: every token is masked in row(s) {rows}")

        if batch.is_all_greedy:
            next_ids = logits.argmax(dim=-1)
        elif not batch.has_greedy:
            next_ids = self._sample(logits, batch)
        else:
            next_ids = torch.empty(b, dtype=torch.int64, device=logits.device)
            next_ids[batch.greedy_rows] = logits[batch.greedy_rows].argmax(dim=-1)
            next_ids[batch.sample_rows] = self._sample(logits[batch.sample_rows], batch)

        logprobs = top = None
        if raw is not None:
            if return_logprob:
                logprobs = raw.gather(1, next_ids.unsqueeze(1)).squeeze(1)
            if max(top_nums, default=0) > 0:
                values, ids = raw.topk(max(top_nums), dim=-1)  # (B, kmax), descending
                values, ids = values.tolist(), ids.tolist()
                top = [TopLogprobs(values[i][:k], ids[i][:k]) for i, k in enumerate(top_nums)]
        return SampleOutput(next_ids, logprobs, top)

    __call__ = forward

    @staticmethod
    def _check(logits: Tensor, batch: SamplingBatch) -> tuple[int, int]:
        if logits.dim() != 2:
            raise ValueError(f"Sampler: logits must be (B, V), got shape {tuple(logits.shape)}")
        if logits.dtype != torch.float32:
            raise ValueError(f"Sampler: logits must be float32 (upcast first), got {logits.dtype}")
        b, width = logits.shape
        if b != batch.batch_size:
            raise ValueError(f"Sampler: logits have {b} rows, the SamplingBatch has {batch.batch_size}")
        if width < batch.vocab_size:
            raise ValueError(f"Sampler: logits have {width} columns, fewer than "
                             f"vocab_size={batch.vocab_size}")
        return b, width

    @staticmethod
    def _top_nums(top_logprobs_num: int | Sequence[int], b: int, vocab_size: int) -> list[int]:
        nums = [top_logprobs_num] * b if isinstance(top_logprobs_num, int) else list(top_logprobs_num)
        if len(nums) != b:
            raise ValueError(f"Sampler: top_logprobs_num has {len(nums)} entries for {b} rows")
        for k in nums:
            if not isinstance(k, int) or isinstance(k, bool) or not 0 <= k <= vocab_size:
                raise ValueError(f"Sampler: top_logprobs_num entries must be in [0, {vocab_size}], "
                                 f"got {k!r}")
        return nums

    def _uniforms(self, batch: SamplingBatch, s: int, device: torch.device) -> Tensor:
        """One U[0, 1) number per sampled row: seeded rows from their own generator, the rest in one draw."""
        u = torch.rand(s) if len(batch.seeded) < s else torch.empty(s)
        for j, g in batch.seeded:
            u[j] = torch.rand((), generator=g)
        return u.to(device)

    def _sample(self, logits: Tensor, batch: SamplingBatch) -> Tensor:
        """(S, V) logits of the sampled rows (scratch) -> (S,) token ids."""
        s, width = logits.shape
        probs = torch.softmax(logits.div_(batch.temperatures), dim=-1)  # (S, V)
        u = self._uniforms(batch, s, logits.device)
        if not batch.need_truncation:
            return _inverse_cdf(probs, u)

        k_len = min(self.candidates, width)
        cand_p, cand_id = probs.topk(k_len, dim=-1)  # (S, K) descending
        truncation = (batch.top_ks, batch.top_ps, batch.min_ps)
        cutoff, complete = _cutoffs(cand_p, *truncation, batch.vocab_size, covers_all=k_len == width)
        # every kept token (p >= cutoff) lies among the candidates
        fits = complete & (cand_p[:, -1] < cutoff) if k_len < width else complete
        out = torch.empty(s, dtype=torch.int64, device=logits.device)

        fast = fits.nonzero().squeeze(1)
        if fast.numel():
            # the kept candidates in vocabulary order, dropped ones moved to the end with p = 0, so that
            # the CDF matches the full-vocabulary one below exactly
            p, ids = cand_p[fast], cand_id[fast]
            keep = p >= cutoff[fast].unsqueeze(1)
            ids = torch.where(keep, ids, width)
            ids, order = ids.sort(dim=-1)
            p = torch.where(keep, p, 0.0).gather(1, order)
            out[fast] = ids.gather(1, _inverse_cdf(p, u[fast]).unsqueeze(1)).squeeze(1)

        slow = (~fits).nonzero().squeeze(1)
        if slow.numel():
            unsure = (~complete).nonzero().squeeze(1)
            if unsure.numel():
                sorted_p = probs[unsure].sort(dim=-1, descending=True).values  # (U, V)
                sub = (t[unsure] if t is not None else None for t in truncation)
                cutoff[unsure] = _cutoffs(sorted_p, *sub, batch.vocab_size, covers_all=True)[0]
            p = probs[slow]
            p = torch.where(p >= cutoff[slow].unsqueeze(1), p, 0.0)
            out[slow] = _inverse_cdf(p, u[slow])
        return out


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
    chunk = max(1, _PROMPT_CHUNK_ELEMENTS // vocab)
    for start in range(0, t, chunk):
        end = min(start + chunk, t)
        lp = torch.log_softmax(logits[start:end], dim=-1, dtype=torch.float32)  # (chunk, vocab)
        out[start:end] = lp.gather(1, targets[start:end].unsqueeze(1)).squeeze(1)
        if top is not None:
            values, ids = lp.topk(top_k, dim=-1)
            top.values[start:end] = values
            top.ids[start:end] = ids
    return PromptLogprobs(out, top)
