"""The problem curriculum (hcjax.rl.curriculum): early exit (exact binomial probabilities vs simulation), the length
curriculum, Kimi prioritised/curriculum sampling, and the Rufus learnability band."""

import math
import random

import pytest

from hcjax.rl import curriculum


def binom_pmf(k, n, p):
    return math.comb(n, k) * p**k * (1 - p) ** (n - k)


def test_early_exit_windows_are_inclusive():
    ee = curriculum.EarlyExit()
    assert not ee.continue_after_early([False] * 16)          # 0/16 < 0.05
    assert ee.continue_after_early([True] + [False] * 15)     # 1/16 = 0.0625
    assert ee.continue_after_early([True] * 12 + [False] * 4)  # 0.75
    assert not ee.continue_after_early([True] * 13 + [False] * 3)  # 0.8125 > 0.8
    ee_small = curriculum.EarlyExit(g_early=5, g=10)
    assert ee_small.continue_after_early([True] * 4 + [False])  # exactly 0.8 is kept
    assert ee_small.keep_after_full([True] + [False] * 9)       # exactly 0.1 is kept
    assert not ee_small.keep_after_full([False] * 10)


def test_early_exit_run_saves_rollouts_on_dropped_problems():
    drawn = []

    def sample(n):
        drawn.append(n)
        return [False] * n

    kept, results = curriculum.EarlyExit().run(sample)
    assert (kept, len(results), drawn) == (False, 16, [16])


@pytest.mark.parametrize("p", [0.02, 0.3, 0.75])
def test_early_exit_statistics_match_the_binomial(p):
    ee = curriculum.EarlyExit()
    rng = random.Random(0)
    trials = 2000
    early_kept = full_kept = rollouts = 0
    for _ in range(trials):
        kept, results = ee.run(lambda n: [rng.random() < p for _ in range(n)])
        early_kept += len(results) == 128
        full_kept += kept
        rollouts += len(results)
    # Early stage: continue iff 1 <= k <= 12 successes out of 16.
    p_continue = sum(binom_pmf(k, 16, p) for k in range(1, 13))
    se = math.sqrt(p_continue * (1 - p_continue) / trials)
    assert abs(early_kept / trials - p_continue) < 4 * se + 1e-9
    assert rollouts == trials * 16 + early_kept * 112
    # Full stage: keep iff 1 <= k16 <= 12 and 13 <= k128 <= 102 (0.1*128 = 12.8, 0.8*128 = 102.4)
    p_keep = sum(binom_pmf(k1, 16, p) * binom_pmf(k2, 112, p)
                 for k1 in range(1, 13) for k2 in range(113) if 13 <= k1 + k2 <= 102)
    se = math.sqrt(max(p_keep * (1 - p_keep), 1e-12) / trials)
    assert abs(full_kept / trials - p_keep) < 4 * se + 1e-3


def test_length_curriculum():
    lc = curriculum.LengthCurriculum(stage_steps=(10, 20, 30, 40))
    assert lc.lengths() == [8192, 16384, 32768, 65536, 131072]
    assert [lc.max_length(s) for s in (0, 9, 10, 29, 30, 59, 60, 99, 100, 10**6)] == [
        8192, 8192, 16384, 16384, 32768, 32768, 65536, 65536, 131072, 131072]
    assert lc.length_penalty_weight(99) == 0.25 and lc.length_penalty_weight(100) == 0.0
    small = curriculum.LengthCurriculum(stage_steps=(5,), start=256, end=512)
    assert [small.max_length(s) for s in (4, 5)] == [256, 512]
    with pytest.raises(ValueError, match="start=1000 is not a power of two"):
        curriculum.LengthCurriculum(start=1000)
    with pytest.raises(ValueError, match="needs 4 positive entries"):
        curriculum.LengthCurriculum(stage_steps=(1, 2))


def test_prioritized_sampling_is_proportional_to_failure_rate():
    sampler = curriculum.PrioritizedSampler({"a": 1, "b": 2, "c": 3, "d": 4}, seed=1)
    sampler.update("a", [True] * 9 + [False])   # success 0.9 -> weight 0.1
    sampler.update("b", [True, False])          # 0.5 -> 0.5
    sampler.update("c", [True] * 4)             # 1.0 -> 0
    # d unseen -> weight 1; total 1.6
    probs = sampler.probabilities()
    assert probs == pytest.approx({"a": 0.1 / 1.6, "b": 0.5 / 1.6, "c": 0.0, "d": 1 / 1.6})
    draws = sampler.sample(16000)
    for k, p in probs.items():
        assert abs(draws.count(k) / 16000 - p) < 4 * math.sqrt(p * (1 - p) / 16000) + 1e-9
    solved = curriculum.PrioritizedSampler({"x": 0, "y": 1})
    solved.update("x", [True])
    solved.update("y", [True])
    assert solved.probabilities() == {"x": 0.5, "y": 0.5}


def test_group_shares_pick_the_group_before_the_rule():
    keys = {"a1": 0, "a2": 1, "b1": 2, "c1": 3}
    groups = {"a1": "A", "a2": "A", "b1": "B", "c1": "C"}
    sampler = curriculum.PrioritizedSampler(keys, groups=groups, shares={"A": 2, "B": 1, "C": 1},
                                            seed=2)
    sampler.update("a1", [False] * 4)         # kimi weight 1
    sampler.update("a2", [True, False])       # 0.5
    sampler.update("b1", [True] * 9 + [False])  # 0.1, alone in its group
    sampler.update("c1", [True] * 3)          # 0: its group's draws fall back to uniform
    # A takes 2/4 of the draws, split 1 : 0.5 inside it; B and C 1/4 each, whatever their
    # success rates (without groups b1 would get 0.1 / 1.6 and c1 nothing).
    probs = sampler.probabilities()
    assert probs == pytest.approx({"a1": 0.5 * 2 / 3, "a2": 0.5 / 3, "b1": 0.25, "c1": 0.25})
    draws = sampler.sample(16000)
    for k, p in probs.items():
        assert abs(draws.count(k) / 16000 - p) < 4 * math.sqrt(p * (1 - p) / 16000)
    # The curriculum pool holds A's keys only at first: A takes every draw.
    early = curriculum.PrioritizedSampler(keys, groups=groups, shares={"A": 2, "B": 1, "C": 1},
                                          initial_fraction=0.5)
    assert early.probabilities(0.0) == pytest.approx({"a1": 0.5, "a2": 0.5})
    with pytest.raises(ValueError, match="give both or neither"):
        curriculum.PrioritizedSampler(keys, groups=groups)
    with pytest.raises(ValueError, match=r"no share for groups \['C'\]"):
        curriculum.PrioritizedSampler(keys, groups=groups, shares={"A": 1, "B": 1})
    with pytest.raises(ValueError, match=r"\['c1'\] without a group"):
        curriculum.PrioritizedSampler(keys, groups={"a1": "A", "a2": "A", "b1": "B"},
                                      shares={"A": 1, "B": 1})
    with pytest.raises(ValueError, match="shares=.*must be non-negative"):
        curriculum.PrioritizedSampler(keys, groups=groups, shares={"A": -1, "B": 1, "C": 0})


def test_curriculum_pool_grows_easy_to_hard():
    sampler = curriculum.PrioritizedSampler({f"p{i}": i for i in range(10)}, initial_fraction=0.3)
    assert sampler.pool(0.0) == ["p0", "p1", "p2"]
    assert sampler.pool(0.5) == [f"p{i}" for i in range(7)]  # ceil(0.65 * 10)
    assert sampler.pool(1.0) == [f"p{i}" for i in range(10)]
    assert set(sampler.sample(200, progress=0.0)) <= {"p0", "p1", "p2"}
    with pytest.raises(ValueError, match="progress=1.5"):
        sampler.pool(1.5)
