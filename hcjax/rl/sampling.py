"""Which problems to roll out, and how long rollouts may be: MAI early-exit sampling and length
curriculum (RECIPE §3), Kimi curriculum and prioritised sampling (§5), Rufus learnability band
over an over-sampled pool (§6).  Pure Python, no JAX: these run on problem workers."""

from __future__ import annotations

import dataclasses
import math
import random
from collections.abc import Callable, Hashable, Mapping, Sequence


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


class PrioritizedSampler:
    """Kimi k1.5: problems drawn with probability proportional to (1 - success rate), within a
    curriculum pool that grows from the easiest `initial_fraction` of problems to all of them as
    `progress` goes 0 -> 1.  Unseen problems count as success rate 0 (highest priority)."""

    def __init__(self, difficulty: Mapping[Hashable, float], *, initial_fraction: float = 1.0,
                 seed: int = 0) -> None:
        if not difficulty:
            raise ValueError("difficulty={} has no problems")
        if not 0.0 < initial_fraction <= 1.0:
            raise ValueError(f"initial_fraction={initial_fraction} is not in (0, 1]")
        self.order = sorted(difficulty, key=lambda k: (difficulty[k], str(k)))  # easy first
        self.initial_fraction = initial_fraction
        self.successes: dict[Hashable, int] = {}
        self.attempts: dict[Hashable, int] = {}
        self.rng = random.Random(seed)

    def update(self, problem: Hashable, correct: Sequence[bool]) -> None:
        self.successes[problem] = self.successes.get(problem, 0) + sum(map(bool, correct))
        self.attempts[problem] = self.attempts.get(problem, 0) + len(correct)

    def success_rate(self, problem: Hashable) -> float:
        n = self.attempts.get(problem, 0)
        return self.successes.get(problem, 0) / n if n else 0.0

    def pool(self, progress: float) -> list[Hashable]:
        if not 0.0 <= progress <= 1.0:
            raise ValueError(f"progress={progress} is not in [0, 1]")
        fraction = self.initial_fraction + (1.0 - self.initial_fraction) * progress
        return self.order[: max(1, math.ceil(fraction * len(self.order)))]

    def probabilities(self, progress: float = 1.0) -> dict[Hashable, float]:
        pool = self.pool(progress)
        weights = [1.0 - self.success_rate(p) for p in pool]
        total = sum(weights)
        if total == 0:  # every problem in the pool is solved: fall back to uniform
            return {p: 1.0 / len(pool) for p in pool}
        return {p: w / total for p, w in zip(pool, weights)}

    def sample(self, n: int, progress: float = 1.0) -> list[Hashable]:
        probs = self.probabilities(progress)
        return self.rng.choices(list(probs), weights=list(probs.values()), k=n)


@dataclasses.dataclass(frozen=True)
class LearnabilityBand:
    """Rufus-Air: keep a prompt only if its group's mean reward is in (low, high]; applied
    online to an over-sampled candidate pool so a full batch survives the filter."""

    low: float = 0.0
    high: float = 0.8
    oversample: float = 2.0

    def __post_init__(self) -> None:
        if not self.low < self.high:
            raise ValueError(f"low={self.low} is not below high={self.high}")
        if self.oversample < 1.0:
            raise ValueError(f"oversample={self.oversample} is below 1")

    def keep(self, rewards: Sequence[float]) -> bool:
        if not rewards:
            raise ValueError("rewards=[] is an empty group")
        mean = sum(rewards) / len(rewards)
        return self.low < mean <= self.high

    def pool_size(self, batch_size: int) -> int:
        return math.ceil(batch_size * self.oversample)

    def select(self, candidates: Sequence[Hashable],
               rollout: Callable[[Hashable], Sequence[float]],
               batch_size: int) -> tuple[list[tuple[Hashable, Sequence[float]]], dict]:
        """Roll out the pool in order, keeping learnable groups until `batch_size` are kept.
        Returns the kept (problem, rewards) and statistics of the filter."""
        pool = list(candidates)[: self.pool_size(batch_size)]
        kept, seen = [], 0
        for problem in pool:
            if len(kept) == batch_size:
                break
            rewards = rollout(problem)
            seen += 1
            if self.keep(rewards):
                kept.append((problem, rewards))
        stats = {"rolled_out": seen, "kept": len(kept), "pool": len(pool),
                 "keep_rate": len(kept) / seen if seen else 0.0, "short": batch_size - len(kept)}
        return kept, stats
