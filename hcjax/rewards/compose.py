"""Combining reward signals: weighted sums, lexicographic shaping within a group and gates
(RECIPE §3), the parts `RewardSpec` composes a suite's rewards from.  Pure Python."""

from __future__ import annotations

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
