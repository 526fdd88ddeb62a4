"""Reward formulas against hand-computed values: eq. (10)/(11), length penalties, composition,
honesty, search agent."""


import pytest

from hcjax.rewards import compose, shaping
from hcjax.rewards.compose import Honesty


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
    # rho=0.5, |y|=4096, l_max=8192 -> 0.25; R = 1 + 0.5 * 0.95 - 0.25 * 0.25 = 1.4125
    r_len = shaping.mai_length_penalty(4096, 0.5, 8192)
    assert r_len == 0.25
    assert shaping.mai_reward(1.0, 0.95, r_len) == pytest.approx(1.4125)
    assert shaping.mai_reward(1.0, 0.95, r_len, w_len=0.0) == pytest.approx(1.475)  # 128K stage
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


def test_honesty_reward():
    assert compose.honesty_reward(Honesty.CONFIDENT_INCORRECT) == -1.0
    assert compose.honesty_reward(Honesty.NOT_ATTEMPTED) == 0.0
    probs = {Honesty.CONFIDENT_CORRECT: 0.5, Honesty.UNCONFIDENT_INCORRECT: 0.5}
    assert compose.honesty_reward(probs) == pytest.approx(0.25)  # 0.5*1 + 0.5*(-0.5)
    bad = dict(compose.DEFAULT_HONESTY_WEIGHTS)
    bad[Honesty.UNCONFIDENT_CORRECT] = 2.0
    with pytest.raises(ValueError, match="not strictly decreasing"):
        compose.honesty_reward(Honesty.NOT_ATTEMPTED, bad)
    with pytest.raises(ValueError, match="not a probability distribution"):
        compose.honesty_reward({Honesty.CONFIDENT_CORRECT: 0.7})


def test_search_agent_reward():
    # s=0.8, 1 malformed of 4 calls: 0.8 * (1 - 0.5 * 0.25) = 0.7
    r = compose.search_agent_reward(0.8, num_calls=4, num_malformed=1, num_successful=3,
                                    answered=True)
    assert r == pytest.approx(0.7)
    assert compose.search_agent_reward(0.8, num_calls=4, num_malformed=0, num_successful=1,
                                       answered=True) == 0.0  # fewer than 2 successful calls
    assert compose.search_agent_reward(0.0, num_calls=9, num_malformed=0, num_successful=9,
                                       answered=False) == -0.1
    with pytest.raises(ValueError, match="num_malformed=5"):
        compose.search_agent_reward(1.0, num_calls=4, num_malformed=5, num_successful=0,
                                    answered=True)
