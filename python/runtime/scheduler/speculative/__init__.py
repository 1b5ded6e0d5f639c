"""Speculative decoding, a stage of the scheduler's decode step: drafters (n-gram: ngram.py; a draft model:
draft_model.py), how many tokens each request drafts (adaptive.py), and the stage itself, from drafting to
acceptance (stage.py)."""

from radixgen.runtime.scheduler.speculative.stage import RequestSpec, Speculator

__all__ = ["RequestSpec", "Speculator"]
