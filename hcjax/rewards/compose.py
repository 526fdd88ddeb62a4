"""Combining reward signals: weighted sums, lexicographic shaping within a group, gates, the
honesty judge's class weights and the search-agent formula (RECIPE §3, §6).  Pure Python."""

from __future__ import annotations

import enum
from collections.abc import Mapping, Sequence


def weighted_sum(components: Mapping[str, float], weights: Mapping[str, float]) -> float:
    """sum_k w_k * r_k over the same set of names (RECIPE eq. 10 is one instance)."""
    if set(components) != set(weights):
        raise ValueError(f"components {sorted(components)} and weights {sorted(weights)} "
                         "name different rewards")
    return sum(weights[k] * components[k] for k in components)


def lexicographic(group: Sequence[Sequence[float]], *, atol: float = 0.0) -> list[float]:
    """Rewards for a group whose responses each carry rewards in priority order.

    A lower-priority reward acts only when every response ties on all higher-priority ones:
    the group is scored by the first priority level on which its responses differ (or the last
    level when they tie everywhere).
    """
    if not group:
        raise ValueError("group=[] is empty")
    levels = len(group[0])
    if levels == 0 or any(len(r) != levels for r in group):
        raise ValueError(f"group={list(map(list, group))!r} needs the same number (>0) of "
                         "rewards per response")
    for level in range(levels):
        values = [r[level] for r in group]
        if max(values) - min(values) > atol:
            return values
    return [r[-1] for r in group]


def gated(reward: float, gates: Sequence[tuple[float, float]], minimum: float) -> float:
    """`reward` if every gate value reaches its threshold, else `minimum` (e.g. an unsafe
    response gets the lowest reward whatever else it does).  gates: (value, threshold) pairs."""
    for value, threshold in gates:
        if value < threshold:
            return minimum
    return reward


class Honesty(enum.Enum):
    """Honesty judge classes, best first (RECIPE §3)."""

    CONFIDENT_CORRECT = "confident_correct"
    UNCONFIDENT_CORRECT = "unconfident_correct"
    NOT_ATTEMPTED = "not_attempted"
    UNCONFIDENT_INCORRECT = "unconfident_incorrect"
    CONFIDENT_INCORRECT = "confident_incorrect"


DEFAULT_HONESTY_WEIGHTS: Mapping[Honesty, float] = {
    Honesty.CONFIDENT_CORRECT: 1.0,
    Honesty.UNCONFIDENT_CORRECT: 0.5,
    Honesty.NOT_ATTEMPTED: 0.0,
    Honesty.UNCONFIDENT_INCORRECT: -0.5,
    Honesty.CONFIDENT_INCORRECT: -1.0,
}


def check_honesty_weights(weights: Mapping[Honesty, float]) -> None:
    """The weights must follow the class order, with NOT_ATTEMPTED neutral (0)."""
    if set(weights) != set(Honesty):
        raise ValueError(f"weights cover {sorted(k.name for k in weights)}, not every class")
    ordered = [weights[c] for c in Honesty]
    if any(a <= b for a, b in zip(ordered, ordered[1:])):
        raise ValueError(f"weights={ordered} are not strictly decreasing in class order")
    if weights[Honesty.NOT_ATTEMPTED] != 0.0:
        raise ValueError(f"NOT_ATTEMPTED weight={weights[Honesty.NOT_ATTEMPTED]} is not 0")


def honesty_reward(judgement: Honesty | Mapping[Honesty, float],
                   weights: Mapping[Honesty, float] = DEFAULT_HONESTY_WEIGHTS) -> float:
    """Weighted sum over the judge's classes: one class, or a probability per class."""
    check_honesty_weights(weights)
    if isinstance(judgement, Honesty):
        return weights[judgement]
    total = sum(judgement.values())
    if any(p < 0 for p in judgement.values()) or abs(total - 1.0) > 1e-6:
        raise ValueError(f"judgement={dict(judgement)!r} is not a probability distribution")
    return sum(weights[c] * p for c, p in judgement.items())


def search_agent_reward(score: float, *, num_calls: int, num_malformed: int,
                        num_successful: int, answered: bool,
                        no_answer_penalty: float = -0.1, min_successful: int = 2) -> float:
    """Rufus search agent: R = s * (1 - 0.5 m), m = malformed / all tool calls; no positive
    reward with fewer than `min_successful` successful calls; -0.1 when the budget ran out
    without an answer."""
    if not 0 <= num_malformed <= num_calls or not 0 <= num_successful <= num_calls:
        raise ValueError(f"num_calls={num_calls}, num_malformed={num_malformed}, "
                         f"num_successful={num_successful} are inconsistent")
    if not answered:
        return no_answer_penalty
    m = num_malformed / num_calls if num_calls else 0.0
    reward = score * (1.0 - 0.5 * m)
    if num_successful < min_successful:
        reward = min(reward, 0.0)
    return reward
