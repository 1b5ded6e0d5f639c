"""Constraints as grammars, where every process can use them: JSON-schema analysis (what is enforced, what is
refused), compiling with xgrammar and its cache, and composing grammars (tool calls, answers after a think
block). The scheduler's per-request matchers and batch bitmasks are runtime/grammar/."""
