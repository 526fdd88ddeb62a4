"""Cyclic reward-model scoring (RECIPE §3): k candidates share one context; each of the k
rotations puts a different candidate first, and that candidate's reward is P(score = 5) read
from the first output token's distribution over the scores 1..5.  The scorer is injected."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Protocol

SCORES = (1, 2, 3, 4, 5)


class Scorer(Protocol):
    """Returns the distribution over scores 1..5 that the reward model assigns to the FIRST
    response of `responses` (the others are context), as 5 probabilities."""

    def __call__(self, prompt: str, responses: Sequence[str]) -> Sequence[float]: ...


def rotations(items: Sequence[str]) -> list[list[str]]:
    """The k cyclic rotations; rotation i starts with items[i]."""
    return [list(items[i:]) + list(items[:i]) for i in range(len(items))]


def _normalised(probs: Sequence[float]) -> list[float]:
    if len(probs) != len(SCORES):
        raise ValueError(f"scorer returned {len(probs)} probabilities; expected {len(SCORES)}")
    if any(p < 0 or not math.isfinite(p) for p in probs) or sum(probs) <= 0:
        raise ValueError(f"scorer returned probs={list(probs)!r}, not a distribution")
    total = sum(probs)
    return [p / total for p in probs]


def cyclic_rewards(prompt: str, responses: Sequence[str], scorer: Scorer) -> list[float]:
    """Reward of response i = P(score = 5 | rotation starting at i)."""
    if not responses:
        raise ValueError("responses=[] is empty")
    return [_normalised(scorer(prompt, rotated))[-1] for rotated in rotations(responses)]


def scorer_from_logits(first_token_logits: Callable[[str, Sequence[str]], Sequence[float]],
                       score_token_ids: Sequence[int]) -> Scorer:
    """Adapt a model call that returns first-token logits over the vocabulary: softmax over the
    logits of the tokens "1".."5" only (every other token is ignored)."""
    if len(score_token_ids) != len(SCORES):
        raise ValueError(f"score_token_ids={list(score_token_ids)} needs {len(SCORES)} ids")

    def scorer(prompt: str, responses: Sequence[str]) -> list[float]:
        logits = first_token_logits(prompt, responses)
        picked = [float(logits[i]) for i in score_token_ids]
        top = max(picked)
        exps = [math.exp(x - top) for x in picked]
        return [e / sum(exps) for e in exps]

    return scorer
