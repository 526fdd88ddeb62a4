"""Which problems to roll out, and how long rollouts may be: MAI early-exit sampling and length
curriculum (RECIPE §3), Kimi curriculum and prioritised sampling (§5).  Rufus's learnability
filter (§6) is `EarlyExit.full_window` (e.g. (0.01, 0.8)) over the problem stream, which replaces
every dropped problem with a new one.  Pure Python, no JAX: these run on problem workers.
(Token sampling, temperature and top-p, is hcjax.rollout.sampling.)"""

from __future__ import annotations

import collections
import dataclasses
import math
from collections.abc import Callable, Hashable, Mapping, Sequence
from typing import Any

import gin
import numpy as np


def _check_window(name: str, window: tuple[float, float]) -> None:
    lo, hi = window
    if not 0.0 <= lo <= hi <= 1.0:
        raise ValueError(f"{name}={window} is not a sub-interval of [0, 1]")


@dataclasses.dataclass(frozen=True)
class EarlyExit:
    """Sample G_early responses; drop the problem if their pass rate is outside `early_window`;
    otherwise sample up to G in total and keep it only if the full pass rate is in
    `full_window` (both windows inclusive)."""

    g_early: int = 16
    g: int = 128
    early_window: tuple[float, float] = (0.05, 0.8)
    full_window: tuple[float, float] = (0.1, 0.8)

    def __post_init__(self) -> None:
        if not 0 < self.g_early <= self.g:
            raise ValueError(f"g_early={self.g_early}, g={self.g}: need 0 < g_early <= g")
        _check_window("early_window", self.early_window)
        _check_window("full_window", self.full_window)

    def continue_after_early(self, early_correct: Sequence[bool]) -> bool:
        if len(early_correct) != self.g_early:
            raise ValueError(f"got {len(early_correct)} early results; expected {self.g_early}")
        rate = sum(early_correct) / self.g_early
        return self.early_window[0] <= rate <= self.early_window[1]

    def keep_after_full(self, all_correct: Sequence[bool]) -> bool:
        if len(all_correct) != self.g:
            raise ValueError(f"got {len(all_correct)} results; expected {self.g}")
        rate = sum(all_correct) / self.g
        return self.full_window[0] <= rate <= self.full_window[1]

    def run(self, sample: Callable[[int], Sequence[bool]]) -> tuple[bool, list[bool]]:
        """Drive one problem: `sample(n)` rolls out n more responses and returns correctness.
        Returns (kept, every result drawn); an early drop costs only G_early rollouts."""
        results = list(sample(self.g_early))
        if not self.continue_after_early(results):
            return False, results
        results += list(sample(self.g - self.g_early))
        return self.keep_after_full(results), results


@gin.configurable
@dataclasses.dataclass(frozen=True)
class LengthCurriculum:
    """Max rollout length doubles from `start` to `end` (8K -> 128K), one stage per entry of
    `stage_steps` (learner steps spent in each stage but the last).  The length penalty weight
    w_len applies until the stage at `no_penalty_from` (RECIPE §3: 0.25, then 0 at 128K)."""

    stage_steps: Sequence[int] = (1000, 1000, 1000, 1000)
    start: int = 8192
    end: int = 131072
    w_len: float = 0.25
    no_penalty_from: int = 131072

    def __post_init__(self) -> None:
        for name in ("start", "end"):
            value = getattr(self, name)
            if value <= 0 or value & (value - 1):
                raise ValueError(f"{name}={value} is not a power of two")
        if self.start > self.end:
            raise ValueError(f"start={self.start} > end={self.end}")
        stages = int(math.log2(self.end // self.start)) + 1
        if len(self.stage_steps) != stages - 1 or any(s <= 0 for s in self.stage_steps):
            raise ValueError(f"stage_steps={list(self.stage_steps)} needs {stages - 1} positive "
                             f"entries for the {stages} stages {self.lengths()}")

    def lengths(self) -> list[int]:
        out, n = [], self.start
        while n <= self.end:
            out.append(n)
            n *= 2
        return out

    def max_length(self, step: int) -> int:
        if step < 0:
            raise ValueError(f"step={step} is negative")
        boundary = 0
        for length, steps in zip(self.lengths(), self.stage_steps):
            boundary += steps
            if step < boundary:
                return length
        return self.end

    def length_penalty_weight(self, step: int) -> float:
        return 0.0 if self.max_length(step) >= self.no_penalty_from else self.w_len


PRIORITY_RULES = ("kimi", "learnability")


class PrioritizedSampler:
    """Prioritised sampling over keys (problems, or categories of problems), the one
    implementation behind every prioritised source of the climb.

    Each draw picks a key of the curriculum pool with probability ∝ max(w(s), floor), s the key's
    success rate. Rules:
      "kimi"          w = 1 − s (Kimi k1.5, RECIPE §5); unseen keys count as s = 0.
      "learnability"  w = s·(1 − s), the variance of a response's reward: proportional to how
                      much GRPO signal a group carries; unseen keys get the maximum, 1/4.
    s is over every attempt (window=None) or the mean pass rate of the key's last `window`
    groups (task streams where every problem is new, so only categories recur). The curriculum
    pool grows from the easiest `initial_fraction` of keys (by `difficulty`) to all of them as
    `progress` goes 0 -> 1. When every weight is 0 (all solved, floor 0) the draw is uniform.

    groups / shares (optional, together): each key's group (e.g. the member suite of a mixture)
    and each group's share of the draws. A draw then picks a group with probability ∝ its share
    (among the groups with a key in the pool), then a key of that group by the rule, so a group
    keeps its share however its keys' success rates compare with the other groups'.
    """

    def __init__(self, difficulty: Mapping[Hashable, float] | Sequence[Hashable], *,
                 rule: str = "kimi", window: int | None = None, floor: float = 0.0,
                 initial_fraction: float = 1.0, seed: int = 0,
                 groups: Mapping[Hashable, Hashable] | None = None,
                 shares: Mapping[Hashable, float] | None = None) -> None:
        if not difficulty:
            raise ValueError(f"difficulty={difficulty!r} has no keys")
        if rule not in PRIORITY_RULES:
            raise ValueError(f"rule={rule!r} is not one of {PRIORITY_RULES}")
        if not 0.0 < initial_fraction <= 1.0:
            raise ValueError(f"initial_fraction={initial_fraction} is not in (0, 1]")
        if window is not None and window < 1:
            raise ValueError(f"window={window} must be >= 1 or None")
        if not 0.0 <= floor <= 1.0:
            raise ValueError(f"floor={floor} must be in [0, 1]")
        if isinstance(difficulty, Mapping):
            self.order = sorted(difficulty, key=lambda k: (difficulty[k], str(k)))  # easy first
        else:
            self.order = list(difficulty)
            if len(set(self.order)) != len(self.order):
                raise ValueError(f"keys={self.order} has duplicates")
        if (groups is None) != (shares is None):
            raise ValueError(f"groups={groups!r} and shares={shares!r}: give both or neither")
        if groups is not None:
            ungrouped = [k for k in self.order if k not in groups]
            if ungrouped:
                raise ValueError(f"groups leave keys {ungrouped[:8]} without a group")
            used = {groups[k] for k in self.order}
            unshared = sorted(used - set(shares), key=str)
            if unshared:
                raise ValueError(f"shares={dict(shares)} has no share for groups {unshared}")
            if any(not shares[g] >= 0 for g in used) or sum(shares[g] for g in used) <= 0:
                raise ValueError(f"shares={dict(shares)} must be non-negative with a positive "
                                 f"sum over the groups {sorted(map(str, used))}")
        self.groups = dict(groups) if groups is not None else None
        self.shares = dict(shares) if shares is not None else None
        self.rule, self.window, self.floor = rule, window, floor
        self.initial_fraction = initial_fraction
        self._sums: dict[Hashable, list[float]] = {}  # window=None: [successes, attempts]
        self._rates: dict[Hashable, collections.deque[float]] = {}
        self.rng = np.random.default_rng(seed)

    def update(self, key: Hashable, correct: Sequence[bool]) -> None:
        """Record one group's results for `key`."""
        self.observe(key, float(sum(map(bool, correct))), len(correct))

    def observe(self, key: Hashable, successes: float, attempts: int) -> None:
        if key not in self.order:
            raise ValueError(f"unknown key {key!r}; the sampler draws from {self.order[:8]}")
        if attempts < 1:
            return
        if self.window is None:
            s = self._sums.setdefault(key, [0.0, 0.0])
            s[0] += successes
            s[1] += attempts
        else:
            self._rates.setdefault(key, collections.deque(maxlen=self.window)).append(
                successes / attempts)

    def seen(self, key: Hashable) -> bool:
        return key in self._sums or key in self._rates

    def success_rate(self, key: Hashable) -> float:
        if self.window is None:
            s, n = self._sums.get(key, (0.0, 0.0))
            return s / n if n else 0.0
        rates = self._rates.get(key)
        return float(np.mean(rates)) if rates else 0.0

    def weight(self, key: Hashable) -> float:
        s = self.success_rate(key)
        if self.rule == "learnability":
            w = s * (1.0 - s) if self.seen(key) else 0.25
        else:
            w = 1.0 - s
        return max(w, self.floor)

    def pool(self, progress: float) -> list[Hashable]:
        if not 0.0 <= progress <= 1.0:
            raise ValueError(f"progress={progress} is not in [0, 1]")
        fraction = self.initial_fraction + (1.0 - self.initial_fraction) * progress
        return self.order[: max(1, math.ceil(fraction * len(self.order)))]

    def probabilities(self, progress: float = 1.0) -> dict[Hashable, float]:
        pool = self.pool(progress)
        if self.groups is None:
            return _normalised(pool, [self.weight(p) for p in pool])
        members: dict[Hashable, list[Hashable]] = {}
        for p in pool:
            members.setdefault(self.groups[p], []).append(p)
        if sum(self.shares[g] for g in members) == 0:  # only zero-share groups in the pool yet
            return _normalised(pool, [self.weight(p) for p in pool])
        group_p = _normalised(list(members), [self.shares[g] for g in members])
        out: dict[Hashable, float] = {}
        for g, keys in members.items():
            within = _normalised(keys, [self.weight(k) for k in keys])
            out.update({k: group_p[g] * q for k, q in within.items()})
        return {p: out[p] for p in pool}

    def sample(self, n: int, progress: float = 1.0) -> list[Hashable]:
        probs = self.probabilities(progress)
        keys = list(probs)
        picks = self.rng.choice(len(keys), size=n, p=np.asarray(list(probs.values())))
        return [keys[int(i)] for i in picks]

    def state_dict(self) -> dict:
        """JSON-able state (keys as strings: categories and problem ids are strings)."""
        return {"sums": {str(k): v for k, v in self._sums.items()},
                "rates": {str(k): list(v) for k, v in self._rates.items()},
                "rng": self.rng.bit_generator.state}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        by_name = {str(k): k for k in self.order}
        unknown = sorted((set(state["sums"]) | set(state["rates"])) - set(by_name))
        if unknown:
            raise ValueError(f"checkpointed keys {unknown} are not among this sampler's")
        self._sums = {by_name[k]: [float(a), float(b)] for k, (a, b) in state["sums"].items()}
        self._rates = {by_name[k]: collections.deque(map(float, v), maxlen=self.window)
                       for k, v in state["rates"].items()}
        self.rng.bit_generator.state = state["rng"]


def _normalised(keys: Sequence[Hashable], weights: Sequence[float]) -> dict[Hashable, float]:
    """keys -> weight / total, or uniform when every weight is 0."""
    total = sum(weights)
    if total == 0:
        return {k: 1.0 / len(keys) for k in keys}
    return {k: w / total for k, w in zip(keys, weights, strict=True)}
