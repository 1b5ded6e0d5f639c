"""Logits -> token ids: penalties, constraint masks, temperature / top-k / top-p / min-p, logprobs.

The scheduler builds one `SamplingBatch` per step from the requests' `SamplingParams` and calls
`Sampler.forward` once with every row of that step. Work that no row of the batch asks for (penalties,
truncation, per-request generators, logprobs) is skipped entirely.

Sampling is inverse-CDF over the kept tokens taken in vocabulary order, driven by one uniform number per
row. A seeded request draws its number from its own generator, so its tokens depend neither on the
other rows of the batch nor on its row position.

Hostile values never crash a step and never yield a token outside [0, vocab_size): NaN logits count as -inf,
+inf as the largest float32; a temperature below MIN_SAMPLING_TEMPERATURE is greedy; penalized logits stay
finite. A row left with no allowed token (every logit NaN / -inf, or every token masked) gets token 0 and is
listed in `SampleOutput.failed_rows`: the caller fails that request (token 0 is only a placeholder).
Logprobs that would be -inf or NaN are reported as LOGPROB_FLOOR, so they stay plain JSON numbers.

About 420 lines: the truncations (top-k / top-p / min-p) share one sorted-candidates pass with the draw, and
splitting them from it would pass that pass's intermediate tensors across modules.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import NamedTuple

import torch
from torch import Tensor

from radixgen.common.sampling_params import MAX_SEED, MIN_SEED, SamplingParams
from radixgen.runtime.executor.logits_processors import (
    Penalties,
    apply_penalties,
    apply_vocab_mask,
    build_penalties,
    finite_logprobs,
    saturate,
)
from radixgen.runtime.executor.sampler_rows import TORCH_ROWS, TorchRows

# top-k / top-p / min-p cutoffs are first looked for among the heaviest tokens only: on one CPU core a full
# sort of (64, 49152) costs ~220 ms, a top-512 ~17 ms; only rows whose cutoff lies deeper search further.
DEFAULT_CANDIDATES = 512


def make_generator(seed: int) -> torch.Generator:
    """The generator of a seeded request: made once when the request starts, passed at every step."""
    if not isinstance(seed, int) or isinstance(seed, bool) or not MIN_SEED <= seed <= MAX_SEED:
        raise ValueError(f"seed must be an integer in [{MIN_SEED}, {MAX_SEED}], got {seed!r}")
    return torch.Generator(device="cpu").manual_seed(seed)


class TopLogprobs(NamedTuple):
    logprobs: list[float]  # descending
    token_ids: list[int]


class SampleOutput(NamedTuple):
    next_ids: Tensor  # (B,) int64
    logprobs: Tensor | None  # (B,) float32 logprob of next_ids under the raw logits
    top_logprobs: list[TopLogprobs] | None  # one per row (empty where 0 were asked)
    failed_rows: tuple[int, ...] = ()  # rows with no allowed token: next_ids holds 0 there, fail the request


class TopK(NamedTuple):
    values: Tensor  # (T, k) float32, descending
    ids: Tensor  # (T, k) int64


@dataclass(frozen=True, eq=False)
class SamplingBatch:
    """Per-step sampling inputs. Rows split into greedy rows (argmax) and sampled rows; the per-row
    tensors below cover the sampled rows only, and a truncation tensor is None when no sampled row
    uses it, so that step is skipped."""

    batch_size: int
    vocab_size: int
    greedy_rows: Tensor  # (G,) int64
    sample_rows: Tensor  # (S,) int64
    temperatures: Tensor | None  # (S, 1) float32; None when S == 0
    top_ks: Tensor | None  # (S,) int64, vocab_size where disabled
    top_ps: Tensor | None  # (S,) float32, 1.0 where disabled
    min_ps: Tensor | None  # (S,) float32, 0.0 where disabled
    max_top_k: int  # the largest top_k < vocab_size among the sampled rows, 0 when none
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

    @classmethod
    def build(cls, params: Sequence[SamplingParams], output_ids: Sequence[Sequence[int]],
              prompt_ids: Sequence[Sequence[int]], generators: Sequence[torch.Generator | None],
              vocab_size: int, device: str | torch.device = "cpu") -> SamplingBatch:
        """One row per request. `output_ids` feed the frequency/presence penalties, `prompt_ids` +
        `output_ids` the repetition penalty (each read only for rows that have that penalty).
        `generators[i]` is the request's `make_generator(seed)`, required when its params have a seed."""
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

        temps = top_ks = top_ps = min_ps = None
        ks = [min(p.top_k, vocab_size) if p.top_k > 0 else vocab_size for p in sp]
        max_top_k = max((k for k in ks if k < vocab_size), default=0)
        if sp:
            temps = col([p.temperature for p in sp], torch.float32).unsqueeze(1)
            if max_top_k:
                top_ks = col(ks, torch.int64)
            if any(p.top_p < 1.0 for p in sp):
                top_ps = col([p.top_p for p in sp], torch.float32)
            if any(p.min_p > 0.0 for p in sp):
                min_ps = col([p.min_p for p in sp], torch.float32)
        return cls(
            batch_size=n,
            vocab_size=vocab_size,
            greedy_rows=col(greedy, torch.int64),
            sample_rows=col(sampled, torch.int64),
            temperatures=temps,
            top_ks=top_ks,
            top_ps=top_ps,
            min_ps=min_ps,
            max_top_k=max_top_k,
            seeded=tuple((j, generators[i]) for j, i in enumerate(sampled) if generators[i] is not None),
            penalties=build_penalties(params, output_ids, prompt_ids, vocab_size, device),
        )


class _Truncation(NamedTuple):
    """The truncation inputs of some sampled rows (see SamplingBatch); `mass` is each row's total weight."""

    top_ks: Tensor | None
    top_ps: Tensor | None
    min_ps: Tensor | None
    mass: Tensor | None  # (S,), only with top_ps

    def select(self, rows: Tensor) -> _Truncation:
        return _Truncation(*(None if t is None else t[rows] for t in self))


def _cutoffs(sorted_w: Tensor, trunc: _Truncation, vocab: int, covers_all: bool,
             rows: TorchRows = TORCH_ROWS) -> tuple[Tensor, Tensor]:
    """Per-row weight cutoff from `sorted_w` (S, K), the K largest weights of each row in descending order:
    tokens with weight >= cutoff are kept. `complete` is False where K is too short to decide (only when
    not `covers_all`).

    Top-k keeps the k heaviest tokens; top-p then keeps the smallest prefix whose weight, renormalized
    over the top-k survivors, reaches top_p; min-p drops weight < min_p * max weight. Ties with the cutoff
    value are kept."""
    s, k_len = sorted_w.shape
    cutoff = torch.zeros(s, dtype=sorted_w.dtype, device=sorted_w.device)
    complete = torch.ones(s, dtype=torch.bool, device=sorted_w.device)
    limited = None
    if trunc.top_ks is not None:
        limited = trunc.top_ks < vocab
        in_prefix = trunc.top_ks <= k_len
        kth = (trunc.top_ks.clamp(max=k_len) - 1).unsqueeze(1)  # (S, 1)
        cutoff = torch.where(limited & in_prefix, sorted_w.gather(1, kth).squeeze(1), cutoff)
        complete &= ~limited | in_prefix
    if trunc.top_ps is not None:
        csum = rows.cumsum(sorted_w)  # (S, K)
        total = trunc.mass
        if limited is not None:
            total = torch.where(limited, csum.gather(1, kth).squeeze(1), total)
        active = trunc.top_ps < 1.0
        reached = csum >= (trunc.top_ps * total).unsqueeze(1)
        found = reached.any(-1)
        first = reached.to(torch.uint8).argmax(-1, keepdim=True)  # argmax returns the first maximal index
        at_first = sorted_w.gather(1, first).squeeze(1)
        cutoff = torch.where(active & found, torch.maximum(cutoff, at_first), cutoff)
        if not covers_all:  # a whole row that never reaches top_p (rounding) keeps everything
            complete &= ~active | found
    if trunc.min_ps is not None:
        cutoff = torch.maximum(cutoff, trunc.min_ps * sorted_w[:, 0])
    return cutoff, complete


def _inverse_cdf_(weights: Tensor, u: Tensor, rows: TorchRows = TORCH_ROWS) -> Tensor:
    """Index i with cdf[i - 1] <= u * total < cdf[i] in each row of `weights` (n, L) >= 0, which is
    overwritten by its running sum. A zero-weight token is never chosen."""
    cdf = rows.cumsum_(weights)  # (n, L)
    total = cdf[:, -1:]
    v = torch.minimum(u.unsqueeze(1) * total, torch.nextafter(total, torch.zeros_like(total)))
    return torch.searchsorted(cdf, v, right=True).squeeze(1)


class Sampler:
    """`candidates`: how many of the heaviest tokens of a row are searched first for its truncation
    cutoff; rows it cannot decide search 8x more, then the whole sorted row. Only the speed depends on
    it, never the tokens. `rows`: the per-row reductions (BatchInvariantRows: the deterministic mode on CUDA)."""

    def __init__(self, candidates: int = DEFAULT_CANDIDATES, rows: TorchRows = TORCH_ROWS) -> None:
        if candidates < 1:
            raise ValueError(f"Sampler: candidates must be >= 1, got {candidates}")
        self.candidates = candidates
        self.rows = rows

    def forward(self, logits: Tensor, batch: SamplingBatch, vocab_mask: Tensor | None = None,
                apply_mask: Callable[[Tensor], None] | None = None, return_logprob: bool = False,
                top_logprobs_num: int | Sequence[int] = 0) -> SampleOutput:
        """`logits` (B, V >= vocab_size) float32 is used as scratch and modified in place.

        Order: columns >= vocab_size -> -inf; NaN -> -inf, +inf -> the largest float; penalties;
        `vocab_mask`, then `apply_mask(logits)` (the grammar's in-place mask); a row with nothing left gets
        token 0 and is listed in `failed_rows`; greedy rows take the argmax; sampled rows: temperature, top-k,
        top-p, min-p, sample. Logprobs are those of the (sanitized) raw logits, before penalties, masks and
        temperature."""
        b, width = self._check(logits, batch)
        top_nums = self._top_nums(top_logprobs_num, b, batch.vocab_size)
        max_top = max(top_nums, default=0)
        if width > batch.vocab_size:
            logits[:, batch.vocab_size:] = float("-inf")
        if b and not bool(torch.isfinite(logits.amax(dim=-1)).all()):  # amax is NaN / +inf where one is
            saturate(logits)
        raw = None
        if return_logprob or max_top > 0:
            raw = self.rows.log_softmax(logits)  # (B, V), before anything below modifies logits
        if batch.penalties is not None:
            apply_penalties(logits, batch.penalties)
        if vocab_mask is not None:
            apply_vocab_mask(logits, vocab_mask)
        if apply_mask is not None:
            apply_mask(logits)
        failed: list[int] = []
        if b:
            dead = torch.isneginf(logits.amax(dim=-1))  # (B,) no allowed token left
            if bool(dead.any()):
                failed = dead.nonzero().flatten().tolist()
                logits[failed, 0] = 0.0  # token 0, the placeholder, is then the row's only choice

        if batch.is_all_greedy:
            next_ids = self.rows.argmax(logits)
        elif not batch.has_greedy:
            next_ids = self._sample(logits, batch)
        else:
            next_ids = torch.empty(b, dtype=torch.int64, device=logits.device)
            next_ids[batch.greedy_rows] = self.rows.argmax(logits[batch.greedy_rows])
            next_ids[batch.sample_rows] = self._sample(logits[batch.sample_rows], batch)

        outside = (next_ids < 0) | (next_ids >= batch.vocab_size)  # (B,) never expected: a last guard
        if bool(outside.any()):
            rows = outside.nonzero().flatten().tolist()
            next_ids[rows] = 0
            failed = sorted(set(failed) | set(rows))

        logprobs = top = None
        if raw is not None:
            if return_logprob:
                logprobs = finite_logprobs(raw.gather(1, next_ids.unsqueeze(1)).squeeze(1))
            if max_top > 0:
                values, ids = raw.topk(max_top, dim=-1)  # (B, kmax), descending
                values, ids = finite_logprobs(values).tolist(), ids.tolist()
                top = [TopLogprobs(values[i][:k], ids[i][:k]) for i, k in enumerate(top_nums)]
        return SampleOutput(next_ids, logprobs, top, tuple(failed))

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

    @staticmethod
    def _uniforms(batch: SamplingBatch, s: int, device: torch.device) -> Tensor:
        """One U[0, 1) number per sampled row: seeded rows from their own generator, the rest in one draw."""
        u = torch.rand(s) if len(batch.seeded) < s else torch.empty(s)
        for j, g in batch.seeded:
            u[j] = torch.rand((), generator=g)
        return u.to(device)

    def _sample(self, logits: Tensor, batch: SamplingBatch) -> Tensor:
        """(S, V) logits of the sampled rows (scratch) -> (S,) token ids."""
        # unnormalized probabilities exp((x - max) / T), in place: the inverse CDF and the cutoffs only need
        # ratios, which saves the softmax's (S, V) allocation; the heaviest token weighs exactly 1.
        w = logits.sub_(logits.amax(dim=-1, keepdim=True)).div_(batch.temperatures).exp_()  # (S, V)
        u = self._uniforms(batch, w.shape[0], w.device)
        if not batch.need_truncation:
            return _inverse_cdf_(w, u, self.rows)
        mass = self.rows.sum(w) if batch.need_top_p else None
        return self._sample_truncated(w, u, _Truncation(batch.top_ks, batch.top_ps, batch.min_ps, mass),
                                      batch.vocab_size, batch.max_top_k)

    def _sample_truncated(self, w: Tensor, u: Tensor, trunc: _Truncation, vocab: int,
                          max_top_k: int) -> Tensor:
        """Find each row's cutoff among its heaviest tokens (widening the search for rows it cannot decide),
        then draw from the kept tokens in vocabulary order: among the candidates when they hold every kept
        token, else over the whole row. Both give the same token for the same u."""
        s, width = w.shape
        out = torch.empty(s, dtype=torch.int64, device=w.device)
        cutoff = torch.zeros(s, dtype=w.dtype, device=w.device)
        whole_rows = []  # rows drawn over the whole vocabulary
        pending = torch.arange(s, device=w.device)
        only_top_k = trunc.top_ps is None and trunc.min_ps is None
        # top-k alone is decided by its k + 1 heaviest tokens (the extra one shows there is no tie beyond)
        k_len = min(self.candidates, max_top_k + 1) if only_top_k else self.candidates
        while pending.numel():
            k_len = min(k_len, width)
            rows_w = w if pending.numel() == s else w[pending]
            part = trunc if pending.numel() == s else trunc.select(pending)
            if k_len < width:
                cand_w, cand_id = rows_w.topk(k_len, dim=-1)  # (P, K) descending
            else:
                cand_w, cand_id = rows_w.sort(dim=-1, descending=True).values, None
            c, complete = _cutoffs(cand_w, part, vocab, covers_all=cand_id is None, rows=self.rows)
            cutoff[pending] = c
            if cand_id is None or self.rows.whole_rows:
                fits = torch.zeros_like(complete)
            else:
                fits = complete & (cand_w[:, -1] < c)
            if bool(fits.any()):
                rows = pending[fits]
                out[rows] = self._draw_among(cand_w[fits], cand_id[fits], c[fits], u[rows], width)
            whole_rows.append(pending[complete & ~fits])
            pending = pending[~complete]
            k_len = k_len * 8 if k_len * 8 < width // 2 else width
        rows = torch.cat(whole_rows).sort().values
        if rows.numel():
            rows_w = w if rows.numel() == s else w[rows]
            c = cutoff[rows].unsqueeze(1)
            if bool((c > 0).any()):
                rows_w.masked_fill_(rows_w < c, 0.0)
            out[rows] = _inverse_cdf_(rows_w, u[rows], self.rows)
        return out

    @staticmethod
    def _draw_among(cand_w: Tensor, cand_id: Tensor, cutoff: Tensor, u: Tensor, width: int) -> Tensor:
        """Draw among the candidates with weight >= cutoff, taken in vocabulary order (dropped ones sort last
        with weight 0), so the running sums equal those over the whole masked row."""
        keep = cand_w >= cutoff.unsqueeze(1)  # (n, K)
        ids, order = torch.where(keep, cand_id, width).sort(dim=-1)
        weights = torch.where(keep, cand_w, 0.0).gather(1, order)
        return ids.gather(1, _inverse_cdf_(weights, u).unsqueeze(1)).squeeze(1)
