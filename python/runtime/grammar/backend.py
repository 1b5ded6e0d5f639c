"""The scheduler's grammar backend: tokenizer info with the stop tokens, compiles (through CompileCache),
matchers, and the batch bitmask applied to the logits of one sampling step."""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence

import torch
import xgrammar as xgr

from radixgen.common.grammar.compile import CacheInfo, CompileCache, CompiledConstraint, CompileHandle
from radixgen.common.grammar.schema import ConstraintError
from radixgen.kernels import cpu as cpu_kernels
from radixgen.kernels.cpu_bitmask import apply_token_bitmask
from radixgen.runtime.config import JSON_WHITESPACE
from radixgen.runtime.grammar.matcher import Matcher, jump_forward
from radixgen.runtime.special_tokens import eos_token_ids


class GrammarBackend:
    """Owns the tokenizer info, the compile cache (its compiler and thread pool) and the bitmask buffer."""

    def __init__(self, tokenizer, vocab_size: int, *, stop_token_ids: Sequence[int] | None = None,
                 num_threads: int = 2, compile_timeout_s: float = 30.0, strict_json: bool = False,
                 json_whitespace: str = "compact", max_whitespace: int = 8, cache_limit_mb: float = 256) -> None:
        if json_whitespace not in JSON_WHITESPACE:
            raise ValueError(f"json_whitespace must be one of {JSON_WHITESPACE}, got {json_whitespace!r}")
        if num_threads < 1:
            raise ValueError(f"num_threads must be >= 1, got {num_threads}")
        if compile_timeout_s <= 0:
            raise ValueError(f"compile_timeout_s must be > 0, got {compile_timeout_s}")
        if max_whitespace < 1:
            raise ValueError(f"max_whitespace must be >= 1, got {max_whitespace}")
        if cache_limit_mb <= 0:
            raise ValueError(f"cache_limit_mb must be > 0, got {cache_limit_mb}")
        if stop_token_ids is None:
            stop_token_ids = default_stop_token_ids(tokenizer)
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.stop_token_ids = list(stop_token_ids)
        self.strict_json = strict_json
        self.tokenizer_info = build_tokenizer_info(tokenizer, vocab_size, self.stop_token_ids)
        self.compiles = CompileCache(self.tokenizer_info, num_threads=num_threads,
                                     compile_timeout_s=compile_timeout_s, strict_json=strict_json,
                                     json_whitespace=json_whitespace, max_whitespace=max_whitespace,
                                     cache_limit_mb=cache_limit_mb)
        self._batch = xgr.BatchGrammarMatcher(max_threads=num_threads)
        self._bitmask: torch.Tensor | None = None  # mask_fn's buffer, grown on demand

    # -- compile

    def submit(self, kind: str, text: str) -> CompileHandle:
        """Start (or share) the compile of (kind, text); never raises for a bad constraint: the
        handle's result() does."""
        return self.compiles.submit(kind, text)

    def poll(self, handle: CompileHandle) -> CompiledConstraint | ConstraintError | None:
        """Non-blocking: None while compiling, the error when the constraint failed, else the grammar."""
        return self.compiles.poll(handle)

    @property
    def cache_info(self) -> CacheInfo:
        return self.compiles.cache_info

    def new_matcher(self, compiled: CompiledConstraint) -> Matcher:
        return Matcher(compiled)

    def allocate_bitmask(self, batch_size: int) -> torch.Tensor:
        return xgr.allocate_token_bitmask(batch_size, self.vocab_size)  # (B, ceil(V/32)) int32, CPU

    def mask_fn(self, reqs: Sequence, drafts: Sequence[Sequence[int]] | None = None
                ) -> Callable[[torch.Tensor], None] | None:
        """For one sampling step over `reqs` (objects with a `.grammar`: Matcher or None), row i of the
        logits being reqs[i]: fills the bitmask now and returns the in-place masking of the logits
        (None when no row is constrained). With `drafts` (speculative decoding: tokens the matchers accept),
        request i has len(drafts[i]) + 1 consecutive rows, row j masked for its state after drafts[i][:j]."""
        matchers = [r.grammar for r in reqs]
        if all(m is None for m in matchers):
            return None
        n_rows = len(reqs) if drafts is None else sum(len(d) + 1 for d in drafts)
        if self._bitmask is None or self._bitmask.shape[0] < n_rows:
            self._bitmask = self.allocate_bitmask(max(n_rows, 32))
        bitmask = self._bitmask[:n_rows]  # reused across steps: no allocation per step
        if drafts is None:
            rows = self.fill_bitmask(bitmask, matchers)
        else:
            rows = self.fill_draft_bitmask(bitmask, matchers, drafts)
        if not rows:
            return None
        return lambda logits: self.apply_bitmask(logits, bitmask, rows)

    def fill_bitmask(self, bitmask: torch.Tensor, matchers: Sequence[Matcher | None]) -> list[int]:
        """Fill row i for each live matcher i (None: an unconstrained row, left as is); returns those rows."""
        rows = [i for i, m in enumerate(matchers) if m is not None and not m.is_terminated()]
        if rows:
            # One C++ call over a thread pool instead of a Python loop of fills.
            self._batch.batch_fill_next_token_bitmask([matchers[i].xgr_matcher for i in rows], bitmask, rows)
        return rows

    def fill_draft_bitmask(self, bitmask: torch.Tensor, matchers: Sequence[Matcher | None],
                           drafts: Sequence[Sequence[int]]) -> list[int]:
        """mask_fn's rows with drafts: the matchers step through their requests' drafts together, a batched
        fill per draft position, and are rolled back to where they were. Rows past a terminating (stop) token
        stay unconstrained: nothing is sampled after it."""
        firsts = list(itertools.accumulate((len(d) + 1 for d in drafts), initial=0))  # each request's first row
        taken = [0] * len(matchers)
        flat: list[int] = []
        try:
            for j in range(max((len(d) for d in drafts), default=0) + 1):
                live = [i for i, m in enumerate(matchers)
                        if m is not None and j <= len(drafts[i]) and taken[i] == j and not m.is_terminated()]
                if not live:
                    break
                rows = [firsts[i] + j for i in live]
                self._batch.batch_fill_next_token_bitmask([matchers[i].xgr_matcher for i in live], bitmask, rows)
                flat += rows
                for i in live:
                    if j < len(drafts[i]):
                        if not matchers[i].accept_token(drafts[i][j]):
                            raise RuntimeError(f"draft token {drafts[i][j]} is not allowed by the grammar")
                        taken[i] += 1
        finally:
            for m, n in zip(matchers, taken, strict=True):
                if n:
                    m.rollback(n)
        return sorted(flat)

    def apply_bitmask(self, logits: torch.Tensor, bitmask: torch.Tensor, rows: Sequence[int]) -> None:
        """In place on logits (B, V_padded): in `rows`, disallowed ids and ids >= vocab_size get -inf;
        other rows are untouched."""
        if logits.dim() != 2 or logits.shape[1] < self.vocab_size:
            raise ValueError(f"logits: expected (B, >= {self.vocab_size}), got {tuple(logits.shape)}")
        if not rows:
            return
        if (logits.device.type == "cpu" and logits.dtype == torch.float32 and logits.stride(1) == 1
                and cpu_kernels.available()):  # ~20x xgrammar's CPU loop on closed masks (kernels/cpu_bitmask.py)
            apply_token_bitmask(logits, bitmask, rows, self.vocab_size)
            return
        mask = bitmask if bitmask.device == logits.device else bitmask.to(logits.device, non_blocking=True)
        xgr.apply_token_bitmask_inplace(logits, mask, vocab_size=self.vocab_size, indices=list(rows))
        if logits.shape[1] > self.vocab_size:
            idx = torch.tensor(list(rows), device=logits.device)
            logits[idx, self.vocab_size:] = float("-inf")  # padded ids: no token behind them

    def jump_forward(self, matcher: Matcher, tokenizer, prev_ids: Sequence[int] = ()) -> list[int]:
        return jump_forward(matcher, tokenizer, prev_ids)

    def shutdown(self) -> None:
        self.compiles.shutdown()


def default_stop_token_ids(tokenizer) -> list[int]:
    """The tokenizer's end-of-generation ids (radixgen.runtime.special_tokens), ascending (SmolLM2:
    <|endoftext|> 0, <|im_end|> 2)."""
    ids = sorted(eos_token_ids((), tokenizer))
    if not ids:
        raise ValueError("stop_token_ids: the tokenizer has no eos token; pass the model's stop ids")
    return ids


def make_backend(cfg, tokenizer, vocab_size: int,
                 stop_token_ids: Sequence[int] | None = None) -> GrammarBackend:
    """The backend a RuntimeConfig asks for (its grammar_* fields)."""
    return GrammarBackend(tokenizer, vocab_size, stop_token_ids=stop_token_ids,
                          compile_timeout_s=cfg.grammar_compile_timeout_s,
                          strict_json=cfg.grammar_strict_json, json_whitespace=cfg.grammar_json_whitespace)


HARMONY_MARKERS = ("<|start|>", "<|channel|>", "<|message|>", "<|constrain|>", "<|end|>")


def build_tokenizer_info(tokenizer, vocab_size: int, stop_token_ids: Sequence[int]) -> xgr.TokenizerInfo:
    """xgrammar's view of the vocabulary, with special tokens other than the stop tokens blanked (an
    empty token is never allowed): their text would be dropped by the detokenizer."""
    vocab = tokenizer.get_vocab()
    if max(vocab.values()) >= vocab_size:
        raise ValueError(f"vocab_size={vocab_size} is smaller than the tokenizer's vocabulary "
                         f"(max id {max(vocab.values())})")
    bad_stop = [t for t in stop_token_ids if not 0 <= t < vocab_size]
    if bad_stop:
        raise ValueError(f"stop_token_ids: {bad_stop} outside [0, {vocab_size})")
    detected = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size,
                                                   stop_token_ids=list(stop_token_ids))
    encoded = [""] * vocab_size
    for token, idx in vocab.items():
        encoded[idx] = token
    special = set(getattr(tokenizer, "all_special_ids", []))
    special |= {i for i, t in getattr(tokenizer, "added_tokens_decoder", {}).items() if t.special}
    # the harmony format's markers (gpt-oss) stay: its requests keep special tokens in the text, and a forced
    # call's grammar writes them (grammar/tool_formats.harmony_calls)
    special -= {vocab[m] for m in HARMONY_MARKERS if m in vocab}
    for i in special - set(stop_token_ids):
        if 0 <= i < vocab_size:
            encoded[i] = ""
    return xgr.TokenizerInfo(encoded, vocab_type=detected.vocab_type, vocab_size=vocab_size,
                             stop_token_ids=list(stop_token_ids), add_prefix_space=detected.add_prefix_space)
