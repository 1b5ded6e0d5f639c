"""Incremental detokenization: text grows token by token and never ends inside a UTF-8 character."""

from __future__ import annotations


class IncrementalDetokenizer:
    """Decodes a growing list of ids. Text is only released once the bytes of the tokens form whole
    characters (the decoder's U+FFFD replacement marks an incomplete one), and it is decoded with a
    few tokens of left context so that tokenizers which merge spaces across tokens stay right."""

    def __init__(self, tokenizer, skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.skip = skip_special_tokens
        self.ids: list[int] = []
        self.text = ""
        self.prefix_offset = 0  # context window start
        self.read_offset = 0  # ids up to here are already in `text`

    def add(self, new_ids: list[int]) -> str:
        """Append ids; return the newly completed text."""
        self.ids.extend(new_ids)
        decode = self.tokenizer.decode
        prefix = decode(self.ids[self.prefix_offset:self.read_offset], skip_special_tokens=self.skip)
        full = decode(self.ids[self.prefix_offset:], skip_special_tokens=self.skip)
        if len(full) <= len(prefix) or full.endswith("\ufffd"):
            return ""
        delta = full[len(prefix):]
        self.text += delta
        self.prefix_offset = self.read_offset
        self.read_offset = len(self.ids)
        return delta

    def flush(self) -> str:
        """At the end: whatever is left, even an incomplete character."""
        full = self.tokenizer.decode(self.ids, skip_special_tokens=self.skip)
        delta = full[len(self.text):] if full.startswith(self.text) else ""
        self.text = full if delta or full.startswith(self.text) else self.text
        self.read_offset = len(self.ids)
        return delta
