"""Stop regexes matched incrementally, in linear time, over the newly generated text only.

Python's `re.search` backtracks: `(a+)+b` over a long run of 'a's takes exponential time, and searching the
whole output after every token is quadratic anyway. Here each pattern becomes a DFA (interegular), and the
search ("does a match end here, starting anywhere?") runs the subset automaton of that DFA with the start
state re-entered at every character; the subsets are built lazily and memoised, so each character costs a
dict lookup. The state kept per request is one subset id per pattern.

Search semantics as `re.search`, with two differences: the request stops at the first character where any
match ends (the earliest end), and the reported match is the leftmost one ending there. Patterns interegular
cannot turn into an automaton (anchors `^` `$`, `\\b`, backreferences, lookarounds) are rejected up front.
"""

from __future__ import annotations

from functools import lru_cache

# memoised transitions per pattern; past this the memo starts over (bounded memory, still linear time)
MAX_CACHED_TRANSITIONS = 65536


class _SearchAutomaton:
    """One pattern: its DFA (interegular.FSM) and the lazily built subset automaton of `.*(pattern)`.

    A search state is a frozenset of DFA states; transitions are memoised as (state, symbol) -> the canonical
    next state object (so a lookup hashes a set whose hash is already cached)."""

    def __init__(self, pattern: str, fsm) -> None:
        self.pattern = pattern
        self.fsm = fsm
        self.alphabet = fsm.alphabet
        self.start = frozenset([fsm.initial])
        self.next: dict[tuple[frozenset[int], int], tuple[frozenset[int], bool]] = {}
        self.start_accepts = fsm.initial in fsm.finals
        self._pred: dict[int, dict[int, list[int]]] | None = None

    def step(self, state: frozenset[int], ch: str) -> tuple[frozenset[int], bool]:
        """The state after `ch`, and whether a match ends there."""
        sym = self.alphabet[ch]
        hit = self.next.get((state, sym))
        if hit is None:
            fmap = self.fsm.map
            subset = {fmap[s][sym] for s in state if sym in fmap[s]}
            subset.add(self.fsm.initial)  # a match may start at the next character
            nxt = frozenset(subset)
            if len(self.next) >= MAX_CACHED_TRANSITIONS:  # bounded memory; stays linear, only slower
                self.next.clear()
            hit = self.next[(state, sym)] = (nxt, not nxt.isdisjoint(self.fsm.finals))
        return hit

    def match_start(self, text: str, end: int) -> int:
        """The leftmost start of a match of text[:end] ending at `end` (one backward pass over the DFA's
        reversed transitions: linear in `end`)."""
        if self._pred is None:
            pred: dict[int, dict[int, list[int]]] = {}
            for s, edges in self.fsm.map.items():
                for sym, t in edges.items():
                    pred.setdefault(sym, {}).setdefault(t, []).append(s)
            self._pred = pred
        states = set(self.fsm.finals)
        best = end if self.fsm.initial in states else -1
        pos = end
        while states and pos > 0:
            pos -= 1
            by_target = self._pred.get(self.alphabet[text[pos]], {})
            states = {s for t in states for s in by_target.get(t, ())}
            if self.fsm.initial in states:
                best = pos
        return max(best, 0)


@lru_cache(maxsize=256)
def _compile_one(pattern: str) -> _SearchAutomaton:
    import interegular

    try:
        if "(?=" in pattern or "(?!" in pattern:  # interegular would consume what a lookahead only tests
            raise NotImplementedError("lookaheads are not implemented")
        fsm = interegular.parse_pattern(pattern).to_fsm()
    except Exception as e:  # noqa: BLE001 - interegular raises several kinds; all mean "not supported"
        raise ValueError(f"stop_regex {pattern!r} cannot be matched incrementally "
                         f"({type(e).__name__}: {e}); anchors, \\b, backreferences and lookarounds are "
                         f"not supported") from None
    return _SearchAutomaton(pattern, fsm)


def stop_regex_patterns(stop_regex: str | list[str] | tuple[str, ...] | None) -> tuple[str, ...]:
    """The patterns of a `stop_regex` value (a string or a list of strings), validated and compiled; a
    ValueError names the first one that is not a non-empty string or cannot become an automaton."""
    if stop_regex is None:
        return ()
    patterns = [stop_regex] if isinstance(stop_regex, str) else stop_regex
    if not isinstance(patterns, (list, tuple)):
        raise ValueError(f"stop_regex must be a string or a list of strings, got {type(stop_regex).__name__}")
    for p in patterns:
        if not isinstance(p, str) or not p:
            raise ValueError(f"stop_regex must be a non-empty string or a list of them, got {p!r}")
        _compile_one(p)
    return tuple(patterns)


class StopRegexMatcher:
    """Per request: feed the newly decoded text; `feed` returns the matched text once any pattern matches."""

    def __init__(self, stop_regex: str | list[str] | tuple[str, ...]) -> None:
        self.automata = [_compile_one(p) for p in stop_regex_patterns(stop_regex)]
        self.states = [a.start for a in self.automata]
        self.text = ""  # everything fed so far: the match's start is looked up in it once

    def feed(self, new_text: str) -> str | None:
        base = len(self.text)
        self.text += new_text
        if base == 0:  # a pattern that matches the empty string matches at once, as re.search does
            for a in self.automata:
                if a.start_accepts:
                    return ""
        for k, ch in enumerate(new_text):
            for i, a in enumerate(self.automata):
                self.states[i], accepting = a.step(self.states[i], ch)
                if accepting:
                    end = base + k + 1
                    return self.text[a.match_start(self.text, end):end]
        return None
