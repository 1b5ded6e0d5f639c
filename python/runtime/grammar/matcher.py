"""One request's grammar state (a Matcher) and jump-forward: the text a grammar forces next, tokenized the way
the model would write it, prefilled instead of decoded token by token."""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import xgrammar as xgr

from radixgen.common.grammar.compile import CompiledConstraint


class JumpForward(NamedTuple):
    text: str  # the forced text the tokens spell (a prefix of the grammar's forced continuation)
    token_ids: list[int]


_TAIL_TOKENS = 4  # previous tokens re-tokenized with the forced text, enough context for pre-tokenizers


class Matcher:
    """One request's grammar state. Not thread-safe: the scheduler thread owns it."""

    __slots__ = ("constraint", "xgr_matcher", "num_accepted")

    def __init__(self, compiled: CompiledConstraint) -> None:
        self.constraint = compiled
        self.xgr_matcher = xgr.GrammarMatcher(compiled.grammar)  # its bitmask rows: GrammarBackend.fill_bitmask
        self.num_accepted = 0  # tokens accepted since creation, the stop token included

    def accept_token(self, token_id: int) -> bool:
        """False (state unchanged) when the grammar does not allow `token_id` here."""
        if self.xgr_matcher.is_terminated():
            return False
        ok = self.xgr_matcher.accept_token(token_id)
        self.num_accepted += ok
        return ok

    def accept_tokens(self, token_ids: Sequence[int]) -> bool:
        """All or nothing: on the first refusal the ones already accepted are rolled back."""
        for n, t in enumerate(token_ids):
            if not self.accept_token(t):
                self.rollback(n)
                return False
        return True

    def accepted_prefix_len(self, token_ids: Sequence[int]) -> int:
        """How many leading tokens of `token_ids` the grammar accepts one after another (up to the first refusal,
        or the stop token that terminates it); the state is left as it was (speculative drafts are checked so)."""
        n = 0
        while n < len(token_ids) and self.accept_token(token_ids[n]):
            n += 1
        self.rollback(n)
        return n

    def is_terminated(self) -> bool:
        """A stop token was accepted: the request finishes with reason "stop"."""
        return self.xgr_matcher.is_terminated()

    def rollback(self, num_tokens: int) -> None:
        if not 0 <= num_tokens <= self.num_accepted:
            raise ValueError(f"rollback: num_tokens must be in [0, {self.num_accepted}], got {num_tokens}")
        if num_tokens:
            self.xgr_matcher.rollback(num_tokens)
            self.num_accepted -= num_tokens

    def find_jump_forward(self, tokenizer, prev_ids: Sequence[int] = ()) -> JumpForward:
        """Tokens for the text the grammar forces next, in the tokenizer's own segmentation, without
        accepting them. The forced text is re-tokenized after the last few tokens of `prev_ids` (the
        request's tokens so far); when the natural segmentation merges old text with forced text the
        model emits that token itself (no jump). The last forced token is left to the model too, so it
        can merge with what follows (e.g. `":"` + the value's opening quote)."""
        forced = self.xgr_matcher.find_jump_forward_string()
        if not forced or not getattr(tokenizer, "is_fast", False):
            return JumpForward("", [])
        tail_ids = list(prev_ids[-_TAIL_TOKENS:])
        tail = tokenizer.decode(tail_ids, skip_special_tokens=False, clean_up_tokenization_spaces=False) \
            if tail_ids else ""
        text = tail + forced
        enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        ids, offsets = enc["input_ids"], enc["offset_mapping"]
        start = len(tail)
        first = next((i for i, (_, e) in enumerate(offsets) if e > start), len(ids))
        if first == len(ids) or offsets[first][0] != start:
            return JumpForward("", [])  # [start, end) of the first forced token: must begin at the boundary
        body = ids[first:-1]  # [first, last): the last token may merge with the next generated text
        if not body:
            return JumpForward("", [])
        return JumpForward(text[start:offsets[first + len(body) - 1][1]], body)


def jump_forward(matcher: Matcher, tokenizer, prev_ids: Sequence[int] = ()) -> list[int]:
    """The scheduler's jump-forward step: the forced tokens, already accepted by `matcher` (empty when
    nothing is forced or the grammar refuses the tokenization). Prefill them instead of decoding."""
    jf = matcher.find_jump_forward(tokenizer, prev_ids)
    if jf.token_ids and matcher.accept_tokens(jf.token_ids):
        return jf.token_ids
    return []
