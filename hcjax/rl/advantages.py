"""Group-relative advantage estimators (RECIPE §3, §6) as pure numpy functions, selected by name.

Aborted rollouts (infrastructure failures) are never scored: they are left out of every group
statistic and get advantage 0 (the batch layout also drops them from the loss). A group whose
valid rewards are all equal carries no signal and gets advantage 0. No JAX here: this runs on hosts.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import numpy as np

from hcjax.rollout.records import Rollout

__all__ = [
    "ADVANTAGES",
    "assign_advantages",
    "group_advantages",
    "mean_only_advantages",
    "mean_std_advantages",
]


def _groups(group_ids: Sequence) -> list[np.ndarray]:
    index: dict = {}
    for i, g in enumerate(group_ids):
        index.setdefault(g, []).append(i)
    return [np.asarray(v) for v in index.values()]


def group_advantages(
    rewards: np.ndarray,
    group_ids: Sequence,
    valid: np.ndarray | None = None,
    *,
    normalize_std: bool = True,
    std_floor: float = 1e-6,
) -> np.ndarray:
    """float32 [N]: A_i = (R_i - mean_g(R)) / std_g(R), or R_i - mean_g(R) without std.

    mean and (population) std are over the *valid* members of each group only; invalid (aborted)
    entries get 0 and their reward is never read (it may be NaN). A group whose valid std is below
    `std_floor` gets 0 for all members: dividing by ~0 would blow noise up into a huge signal.
    """
    rewards = np.asarray(rewards, np.float64)
    n = rewards.shape[0]
    if rewards.ndim != 1:
        raise ValueError(f"rewards shape {rewards.shape} must be [N]")
    if len(group_ids) != n:
        raise ValueError(f"len(group_ids)={len(group_ids)} != number of rewards {n}")
    valid = np.ones(n, bool) if valid is None else np.asarray(valid, bool)
    if valid.shape != (n,):
        raise ValueError(f"valid shape {valid.shape} must be [N]=({n},)")
    bad = valid & ~np.isfinite(rewards)
    if bad.any():
        raise ValueError(f"non-finite reward {rewards[bad][0]} at index {np.flatnonzero(bad)[0]}")
    out = np.zeros(n, np.float64)
    for members in _groups(group_ids):
        members = members[valid[members]]
        if members.size == 0:
            continue
        r = rewards[members]
        centred = r - r.mean()
        if normalize_std:
            std = r.std()
            centred = centred / std if std >= std_floor else np.zeros_like(centred)
        out[members] = centred
    return out.astype(np.float32)


def mean_std_advantages(rewards, group_ids, valid=None) -> np.ndarray:
    """GRPO's group-normalised advantage (RECIPE §3)."""
    return group_advantages(rewards, group_ids, valid, normalize_std=True)


def mean_only_advantages(rewards, group_ids, valid=None) -> np.ndarray:
    """Mean-only advantage, for noisy judges (RECIPE §6, search agent) and the Kimi loss."""
    return group_advantages(rewards, group_ids, valid, normalize_std=False)


ADVANTAGES: dict[str, Callable[..., np.ndarray]] = {
    "mean_std": mean_std_advantages,
    "mean": mean_only_advantages,
}


def assign_advantages(rollouts: Sequence[Rollout], estimator: str = "mean_std") -> list[Rollout]:
    """Copies of `rollouts` with `advantage` set per group; aborted ones get 0 (and stay aborted).

    Every non-aborted rollout must have a reward.
    """
    if estimator not in ADVANTAGES:
        raise ValueError(f"advantage estimator {estimator!r} is not one of {sorted(ADVANTAGES)}")
    valid = np.array([not r.aborted for r in rollouts], bool)
    for i, r in enumerate(rollouts):
        if valid[i] and r.reward is None:
            raise ValueError(
                f"rollout {i} (group {r.group_id!r}, finish_reason={r.finish_reason!r}) has no reward"
            )
    rewards = np.array([r.reward if v else np.nan for r, v in zip(rollouts, valid)], np.float64)
    adv = ADVANTAGES[estimator](rewards, [r.group_id for r in rollouts], valid)
    return [dataclasses.replace(r, advantage=float(a)) for r, a in zip(rollouts, adv)]
