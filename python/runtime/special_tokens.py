"""The one derivation of a model's end-of-generation token ids (used by the Engine, the scheduler's stop check
and the grammar matcher's allowed end tokens)."""

from __future__ import annotations

from collections.abc import Iterable

# special tokens that end a text in the chat formats we know, wherever a tokenizer declares them
END_TOKENS = ("<|endoftext|>", "<|im_end|>", "<|eot_id|>", "<|end_of_text|>", "<|end|>", "</s>")


def eos_token_ids(model_eos_ids: Iterable[int], tokenizer) -> tuple[int, ...]:
    """Every id that ends a generation: the model config's eos ids, the tokenizer's eos, and the tokenizer's
    special tokens named in END_TOKENS (SmolLM2: <|im_end|> 2 and <|endoftext|> 0). The tokenizer's eos comes
    first (the one to show as "the" end token), then the others ascending. Empty only when none is known."""
    ids = {int(t) for t in model_eos_ids}
    primary = getattr(tokenizer, "eos_token_id", None) if tokenizer is not None else None
    for i, tok in (getattr(tokenizer, "added_tokens_decoder", None) or {}).items():
        if getattr(tok, "special", False) and getattr(tok, "content", None) in END_TOKENS:
            ids.add(int(i))
    if primary is not None:
        ids.discard(primary)
        return (int(primary), *sorted(ids))
    return tuple(sorted(ids))
