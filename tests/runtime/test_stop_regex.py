"""The stop-regex automaton against a brute-force reference built on `re.fullmatch`: fed text in random
chunks, it reports the leftmost match ending at the earliest position where any match ends."""

from __future__ import annotations

import random
import re

import pytest

from radixgen.common.stop_regex import StopRegexMatcher, stop_regex_patterns

PATTERNS = ["ab", "a+b", "(a|b)c", "[abc]{3}", "b.a", "a*b+c?", "(ab)+c", "c\\d", "(?i)AB", "x|ba"]


def reference(patterns: list[str], text: str) -> tuple[int, str] | None:
    """(end, match) of the earliest-ending match, leftmost among those ending there."""
    for end in range(0, len(text) + 1):
        for start in range(0, end + 1):
            if any(re.fullmatch(p, text[start:end]) for p in patterns):
                return end, text[start:end]
    return None


@pytest.mark.parametrize("seed", range(40))
def test_matches_like_the_brute_force_reference(seed):
    rng = random.Random(seed)
    patterns = rng.sample(PATTERNS, rng.randint(1, 3))
    text = "".join(rng.choice("abc 1\n") for _ in range(rng.randint(1, 40)))
    want = reference(patterns, text)
    m = StopRegexMatcher(patterns if len(patterns) > 1 else patterns[0])
    got, fed = None, 0
    while fed < len(text) and got is None:
        chunk = text[fed:fed + rng.randint(1, 5)]
        got = m.feed(chunk)
        fed += len(chunk)
    if want is None:
        assert got is None
    else:
        end, match = want
        assert got == match, (patterns, text)
        assert fed >= end and fed - len(chunk) < max(end, 1)  # found in the chunk where the match ends


def test_catastrophic_pattern_is_linear():
    m = StopRegexMatcher("(a+)+b")
    for _ in range(5000):  # re.search would need 2^n steps per call here
        assert m.feed("a" * 20) is None
    assert m.feed("ab") == "a" * 100_001 + "b"


def test_rejections_name_the_pattern():
    for bad in ["^a", "a$", r"\bword", r"(a)\1", "a(?=b)", "(?<=a)b"]:
        with pytest.raises(ValueError, match=re.escape(repr(bad))):
            stop_regex_patterns(bad)
    with pytest.raises(ValueError, match="non-empty string"):
        stop_regex_patterns(["ok", ""])
    with pytest.raises(ValueError, match="string or a list"):
        stop_regex_patterns(3)
    assert stop_regex_patterns(["a", "b+"]) == ("a", "b+")
