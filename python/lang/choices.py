"""How `select` decides among choices, from the prompt logprobs of each choice's tokens.

Every method gets, per choice, the logprobs of the tokens that spell the choice after the current
text (`input_token_logprobs`: a list of `(logprob, token_id, text)` per choice) and, when it asks
for them, the same tokens' logprobs without the context (`unconditional_token_logprobs`).
The call signature matches SGLang's choices methods, so custom methods written for it work here.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

TokenLogprobs = list[tuple[float, int, Any]]


class ChoicesDecision(NamedTuple):
    decision: str
    meta_info: dict[str, Any]


def mean_logprob(tokens: TokenLogprobs) -> float:
    if not tokens:
        raise ValueError("select: a choice has no scored tokens")
    return sum(t[0] for t in tokens) / len(tokens)


def argmax_first(values: list[float]) -> int:
    """Index of the largest value; ties go to the earliest choice."""
    best = 0
    for i, v in enumerate(values):
        if v > values[best]:
            best = i
    return best


class ChoicesSamplingMethod:
    """Base class: `__call__` returns a `ChoicesDecision`."""

    name = "base"
    requires_unconditional_logprobs = False

    def __call__(
        self,
        *,
        choices: list[str],
        normalized_prompt_logprobs: list[float],
        input_token_logprobs: list[TokenLogprobs],
        output_token_logprobs: list[TokenLogprobs],
        unconditional_token_logprobs: list[TokenLogprobs] | None = None,
    ) -> ChoicesDecision:
        raise NotImplementedError

    def scores(self, **kwargs: Any) -> list[float] | None:
        """Per-choice scores that `select(temperature>0)` samples from; None if not defined."""
        return None

    def __repr__(self) -> str:
        return self.name


class TokenLengthNormalized(ChoicesSamplingMethod):
    """The choice with the highest mean token logprob."""

    name = "token_length_normalized"

    def scores(self, *, normalized_prompt_logprobs: list[float], **_: Any) -> list[float]:
        return list(normalized_prompt_logprobs)

    def __call__(self, *, choices, normalized_prompt_logprobs, **kwargs) -> ChoicesDecision:
        best = argmax_first(normalized_prompt_logprobs)
        return ChoicesDecision(choices[best], {"scores": list(normalized_prompt_logprobs)})


class GreedyTokenSelection(ChoicesSamplingMethod):
    """Compare choices token by token: at each position keep only the choices whose token logprob
    is the largest; stop when one is left. A shorter choice continues with its own mean logprob
    (so it neither wins nor loses just by ending). Remaining ties go to the earliest choice."""

    name = "greedy_token_selection"

    def __call__(self, *, choices, input_token_logprobs, **kwargs) -> ChoicesDecision:
        rows = [[t[0] for t in tokens] for tokens in input_token_logprobs]
        width = max(len(r) for r in rows)
        padded = [r + [sum(r) / len(r)] * (width - len(r)) for r in rows]  # (num_choices, width)
        remaining = list(range(len(rows)))
        for j in range(width):
            top = max(padded[i][j] for i in remaining)
            remaining = [i for i in remaining if padded[i][j] == top]
            if len(remaining) == 1:
                break
        return ChoicesDecision(choices[remaining[0]], {"greedy_logprob_matrix": padded})


class UnconditionalLikelihoodNormalized(ChoicesSamplingMethod):
    """The choice whose mean logprob gains most from the context: mean conditional logprob minus
    mean unconditional logprob (the choice after no context, or after just the role header)."""

    name = "unconditional_likelihood_normalized"
    requires_unconditional_logprobs = True

    def scores(self, *, input_token_logprobs, unconditional_token_logprobs, **_: Any) -> list[float]:
        if unconditional_token_logprobs is None:
            raise ValueError("unconditional_likelihood_normalized needs unconditional_token_logprobs")
        return [
            mean_logprob(cond) - mean_logprob(uncond)
            for cond, uncond in zip(input_token_logprobs, unconditional_token_logprobs, strict=True)
        ]

    def __call__(self, *, choices, input_token_logprobs, unconditional_token_logprobs=None, **kwargs):
        scores = self.scores(
            input_token_logprobs=input_token_logprobs,
            unconditional_token_logprobs=unconditional_token_logprobs,
        )
        best = argmax_first(scores)
        return ChoicesDecision(choices[best], {"scores": scores})


token_length_normalized = TokenLengthNormalized()
greedy_token_selection = GreedyTokenSelection()
unconditional_likelihood_normalized = UnconditionalLikelihoodNormalized()

METHODS = {m.name: m for m in (token_length_normalized, greedy_token_selection, unconditional_likelihood_normalized)}


def resolve_method(method: Any) -> ChoicesSamplingMethod:
    """Accept a method object or its name."""
    if isinstance(method, str):
        if method not in METHODS:
            raise ValueError(f"select.choices_method: unknown method {method!r}; known: {sorted(METHODS)}")
        return METHODS[method]
    if not callable(method):
        raise ValueError(f"select.choices_method: expected a choices method, got {type(method).__name__}")
    return method


def decide(
    method: ChoicesSamplingMethod,
    choices: list[str],
    input_token_logprobs: list[TokenLogprobs],
    unconditional_token_logprobs: list[TokenLogprobs] | None,
    temperature: float = 0.0,
    rng: Any = None,
) -> ChoicesDecision:
    """Run `method`; with temperature > 0 sample a choice from softmax(scores / temperature)."""
    kwargs = dict(
        choices=list(choices),
        normalized_prompt_logprobs=[mean_logprob(t) for t in input_token_logprobs],
        input_token_logprobs=input_token_logprobs,
        output_token_logprobs=[[] for _ in choices],
        unconditional_token_logprobs=unconditional_token_logprobs,
    )
    result = method(**kwargs)
    meta = {
        "choices": list(choices),
        "choices_method": getattr(method, "name", repr(method)),
        "normalized_prompt_logprobs": kwargs["normalized_prompt_logprobs"],
        "input_token_logprobs": input_token_logprobs,
        "unconditional_token_logprobs": unconditional_token_logprobs,
        **result.meta_info,
    }
    if temperature > 0:
        scores = method.scores(**kwargs) if isinstance(method, ChoicesSamplingMethod) else None
        if scores is None:
            raise ValueError(f"select.temperature > 0 is not defined for the {method!r} method (it has no scores)")
        top = max(scores)
        weights = [math.exp((s - top) / temperature) for s in scores]
        if rng is None:
            import random

            rng = random
        pick = rng.choices(range(len(choices)), weights=weights)[0]
        meta["sampled_with_temperature"] = temperature
        return ChoicesDecision(choices[pick], meta)
    return ChoicesDecision(result.decision, meta)
