"""Reward formulas against hand-computed values: eq. (10)/(11), length penalties, composition."""


import pytest

from hcjax.rewards import compose, shaping
from hcjax.rewards.spec import RewardSpec
from hcjax.rewards.types import Grade


def test_language_reward_counts_non_english_words():
    assert shaping.count_non_english_words("The answer is 42, clearly.") == 0
    assert shaping.count_non_english_words("so 我们 get café and Straße") == 4  # 我, 们, café, Straße
    assert shaping.language_reward("all english words") == 1.0
    # 10 non-English words: 1 - 0.005 * 10 = 0.95; 300 of them clip at 0.
    assert shaping.language_reward("x " + "日" * 10) == pytest.approx(0.95)
    assert shaping.language_reward("日" * 300) == 0.0
    with pytest.raises(ValueError, match="alpha=-1"):
        shaping.language_reward("x", alpha=-1)


def test_mai_length_penalty_and_total_reward():
    # rho=0.5, |y|=4096, l_max=8192 -> 0.25; R = 1 + 0.5 * 0.95 - 0.25 * 0.25 = 1.4125 (eq. 10,
    # composed by RewardSpec: 10 non-English words give R_lang = 0.95).
    r_len = shaping.mai_length_penalty(4096, 0.5, 8192)
    assert r_len == 0.25
    group = [Grade(reward=1.0), Grade(reward=0.0)]
    texts = ["x " + "日" * 10, "wrong"]
    for w_len, want in ((0.25, 1.4125), (0.0, 1.475)):  # w_len 0: the 128K stage
        spec = RewardSpec(length="mai", length_weight=w_len, language_weight=0.5)
        got = spec.group_rewards(group, [4096, 4096], max_length=8192, texts=texts)
        assert got[0].reward == pytest.approx(want)
    with pytest.raises(ValueError, match="pass_rate=1.5"):
        shaping.mai_length_penalty(10, 1.5, 100)


def test_kimi_length_rewards():
    # lengths 100..300: lambda = 0.5, 0, -0.5; the wrong middle one keeps min(0, 0) = 0.
    got = shaping.kimi_length_rewards([100, 200, 300, 100], [True, False, True, False])
    assert got == [0.5, 0.0, -0.5, 0.0]
    assert shaping.kimi_length_rewards([7, 7], [True, False]) == [0.0, 0.0]
    with pytest.raises(ValueError, match="len\\(lengths\\)=2 != len\\(correct\\)=1"):
        shaping.kimi_length_rewards([1, 2], [True])


def test_shortest_correct_penalty():
    # shortest correct = 100: 0.1 * (1 - 100/100) = 0, 0.1 * (1 - 100/400) = 0.075; wrong -> 0.
    got = shaping.shortest_correct_penalties([100, 400, 50], [True, True, False])
    assert got == pytest.approx([0.0, 0.075, 0.0])
    assert shaping.shortest_correct_penalties([10, 20], [False, False]) == [0.0, 0.0]


def test_weighted_sum():
    assert compose.weighted_sum({"task": 1.0, "lang": 0.8}, {"task": 1.0, "lang": 0.5}) == 1.4
    with pytest.raises(ValueError, match="name different rewards"):
        compose.weighted_sum({"task": 1.0}, {"lang": 0.5})


def test_lexicographic_lower_priority_acts_only_on_ties():
    # Safety differs -> it decides alone, helpfulness is ignored.
    assert compose.lexicographic([(1, 0.2), (0, 0.9), (1, 0.5)]) == [1, 0, 1]
    # Everyone is safe -> helpfulness decides.
    assert compose.lexicographic([(1, 0.2), (1, 0.9), (1, 0.5)]) == [0.2, 0.9, 0.5]
    # Three levels, the first two tie.
    assert compose.lexicographic([(1, 2, 3), (1, 2, 5)]) == [3, 5]
    assert compose.lexicographic([(1.0, 1), (1.05, 2)], atol=0.1) == [1, 2]
    with pytest.raises(ValueError, match="same number"):
        compose.lexicographic([(1, 2), (1,)])


def test_gated():
    assert compose.gated(0.7, [(1.0, 0.5), (0.9, 0.8)], minimum=-1.0) == 0.7
    assert compose.gated(0.7, [(0.2, 0.5)], minimum=-1.0) == -1.0  # unsafe: minimum regardless
    assert compose.gated(0.7, [], minimum=-1.0) == 0.7
