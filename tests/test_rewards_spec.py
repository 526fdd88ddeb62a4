"""RewardSpec: per-suite reward composition over a group, checked against hand-computed numbers
(every expected value is an exact binary fraction, so most comparisons are ==)."""

from __future__ import annotations

import gin
import pytest

from hcjax.rewards.spec import RewardSpec
from hcjax.rewards.types import Grade
from hcjax.rl.curriculum import LengthCurriculum


def binary(correct: list[bool], **components: list[float]) -> list[Grade]:
    return [Grade(reward=float(ok), correct=ok,
                  components={k: v[i] for k, v in components.items()})
            for i, ok in enumerate(correct)]


ABORTED = Grade(reward=0.0, reason="sandbox died", aborted=True)


def rewards(grades: list[Grade]) -> list[float]:
    return [g.reward for g in grades]


@pytest.fixture
def clean_gin():
    gin.clear_config()
    yield
    gin.clear_config()


# --- identity -------------------------------------------------------------------------------

def test_default_spec_is_identity():
    grades = binary([True, False], strict=[1.0, 0.0]) + [ABORTED]
    assert RewardSpec().is_identity
    for out in (RewardSpec().group_rewards(grades, [5, 7, 9], max_length=16),
                RewardSpec().group_rewards(grades, [5, 7, 9])):
        assert all(a is b for a, b in zip(out, grades)) and len(out) == 3


# --- composition ----------------------------------------------------------------------------

def test_weighted_sum_of_named_components():
    grades = binary([True, False, False], strict=[1.0, 0.0, 0.0], flexible=[1.0, 1.0, 0.0])
    spec = RewardSpec(weights={"strict": 0.75, "flexible": 0.25})
    out = spec.group_rewards(grades, [10, 10, 10])
    assert rewards(out) == [1.0, 0.25, 0.0]
    assert out[1].components == {"strict": 0.0, "flexible": 1.0, "task": 0.0}
    assert [g.correct for g in out] == [True, False, False]


def test_negative_component_weight_is_allowed():
    grades = [Grade(reward=1.0, components={"tool_errors": 2.0})]
    out = RewardSpec(weights={"task": 1.0, "tool_errors": -0.125}).group_rewards(grades, [3])
    assert rewards(out) == [0.75]


def test_lexicographic_lower_level_acts_only_on_ties():
    spec = RewardSpec(composition="lexicographic", priority=("safety", "helpful"))
    tied = [Grade(reward=0.0, components={"safety": 1.0, "helpful": h}) for h in (0.25, 0.75, 0.5)]
    assert rewards(spec.group_rewards(tied, [1, 1, 1])) == [0.25, 0.75, 0.5]
    split = [Grade(reward=0.0, components={"safety": s, "helpful": h})
             for s, h in ((1.0, 0.25), (0.0, 0.75), (1.0, 0.5))]
    assert rewards(spec.group_rewards(split, [1, 1, 1])) == [1.0, 0.0, 1.0]
    # An aborted response (different safety) does not break the tie.
    out = spec.group_rewards(tied + [ABORTED], [1, 1, 1, 1])
    assert rewards(out) == [0.25, 0.75, 0.5, 0.0] and out[3] is ABORTED


def test_lexicographic_tie_tolerance():
    grades = [Grade(reward=0.0, components={"safety": s, "helpful": h})
              for s, h in ((1.0, 0.25), (0.96875, 0.75))]
    exact = RewardSpec(composition="lexicographic", priority=("safety", "helpful"))
    loose = RewardSpec(composition="lexicographic", priority=("safety", "helpful"),
                       tie_atol=0.0625)
    assert rewards(exact.group_rewards(grades, [1, 1])) == [1.0, 0.96875]
    assert rewards(loose.group_rewards(grades, [1, 1])) == [0.25, 0.75]


def test_gated_failing_gate_gets_minimum_whatever_else():
    grades = [Grade(reward=0.75, components={"safety": 1.0}),
              Grade(reward=1.0, components={"safety": 0.25})]
    spec = RewardSpec(composition="gated", gates=(("safety", 0.5),), gate_minimum=-1.0,
                      language_weight=0.5)
    out = spec.group_rewards(grades, [1, 1], texts=["fine", "fine"])
    assert rewards(out) == [0.75 + 0.5, -1.0]  # the gate overrides the language bonus too
    assert out[1].components["lang"] == 1.0


# --- length terms ---------------------------------------------------------------------------

def test_mai_length_penalty_uses_group_pass_rate():
    # ρ = 2/4 (the aborted response is not counted); R_len = 0.5·n/8000; w_len = 0.25.
    grades = binary([True, True, False, False]) + [ABORTED]
    out = RewardSpec(length="mai").group_rewards(grades, [1000, 3000, 2000, 4000, 6000],
                                                 max_length=8000)
    assert [g.components["len_mai"] for g in out[:4]] == [0.0625, 0.1875, 0.125, 0.25]
    assert rewards(out[:4]) == [1 - 0.015625, 1 - 0.046875, -0.03125, -0.0625]
    assert out[4] is ABORTED


def test_mai_needs_max_length():
    with pytest.raises(ValueError, match="max_length"):
        RewardSpec(length="mai").group_rewards(binary([True]), [5])


def test_kimi_length_reward_after_warmup():
    # λ = 0.5 − (n − 100)/400 = [0.5, 0.25, 0, −0.5]; wrong ones get min(0, λ).
    grades = binary([True, False, True, False])
    spec = RewardSpec(length="kimi", length_weight=0.5, length_warmup_steps=10)
    before = spec.group_rewards(grades, [100, 200, 300, 500], step=9)
    after = spec.group_rewards(grades, [100, 200, 300, 500], step=10)
    assert [g.components["len_kimi"] for g in after] == [0.5, 0.0, 0.0, -0.5]
    assert rewards(before) == [1.0, 0.0, 1.0, 0.0]
    assert rewards(after) == [1.25, 0.0, 1.0, -0.25]
    assert spec.length_term_weight(9) == 0.0 and spec.length_term_weight(10) == 0.5


def test_shortest_correct_penalty():
    # Penalty 1 − 100/n for correct answers, times the weight 0.5.
    out = RewardSpec(length="shortest", length_weight=0.5).group_rewards(
        binary([True, True, False]), [100, 200, 400])
    assert [g.components["len_shortest"] for g in out] == [0.0, 0.5, 0.0]
    assert rewards(out) == [1.0, 0.75, 0.0]


def test_curriculum_stage_change_sets_w_len_and_max_length():
    lc = LengthCurriculum(stage_steps=(5,), start=256, end=512, w_len=0.25, no_penalty_from=512)
    spec = RewardSpec(length="mai", curriculum=lc)
    grades = binary([True, False])  # ρ = 0.5
    # Stage 1 (step 0): ℓ_max = 256, w_len = 0.25: R_len = [0.25, 0.5].
    assert rewards(spec.group_rewards(grades, [128, 256], step=0)) == [0.9375, -0.125]
    # An explicit ℓ_max (the length the group was sampled with) wins: R_len = [0.125, 0.25].
    assert rewards(spec.group_rewards(grades, [128, 256], step=0, max_length=512)) == [
        0.96875, -0.0625]
    # Stage 2 (step 5): ℓ_max = 512 ≥ no_penalty_from, so w_len = 0; the term is still logged.
    out = spec.group_rewards(grades, [128, 256], step=5)
    assert rewards(out) == [1.0, 0.0]
    assert [g.components["len_mai"] for g in out] == [0.125, 0.25]


# --- language -------------------------------------------------------------------------------

def test_language_term():
    # "你好" is two non-English words: R_lang = 1 − 0.005·2 = 0.99.
    out = RewardSpec(language_weight=0.5).group_rewards(
        binary([True, False]), [3, 3], texts=["all english", "你好 world"])
    assert [g.components["lang"] for g in out] == [1.0, 0.99]
    assert rewards(out) == pytest.approx([1.5, 0.495])


def test_language_needs_texts():
    with pytest.raises(ValueError, match="language_weight=0.5 needs the decoded texts"):
        RewardSpec(language_weight=0.5).group_rewards(binary([True]), [3])


# --- aborted --------------------------------------------------------------------------------

def test_all_aborted_group_passes_through():
    grades = [ABORTED, ABORTED]
    out = RewardSpec(length="kimi").group_rewards(grades, [1, 2])
    assert out[0] is ABORTED and out[1] is ABORTED


# --- errors ---------------------------------------------------------------------------------

@pytest.mark.parametrize("kwargs, message", [
    ({"composition": "max"}, r"composition='max' is not one of"),
    ({"length": "linear"}, r"length='linear' is not one of"),
    ({"length_weight": -0.25}, r"length_weight=-0.25 is not a non-negative"),
    ({"language_weight": -1.0}, r"language_weight=-1.0 is not a non-negative"),
    ({"length_warmup_steps": -1}, r"length_warmup_steps=-1"),
    ({"composition": "gated", "gates": (("safety", "high"),)},
     r"gates entry \('safety', 'high'\) is not a \(component name, numeric threshold\)"),
    ({"composition": "gated"}, r"gates=\(\) is empty"),
    ({"gates": (("safety", 0.5),)}, r"only used by composition='gated', not 'sum'"),
    ({"composition": "lexicographic"}, r"priority=\(\) is empty"),
    ({"composition": "lexicographic", "priority": "safety"}, r"priority='safety' is a string"),
    ({"priority": ("a",)}, r"only used by composition='lexicographic'"),
    ({"composition": "lexicographic", "priority": ("a",), "weights": {"a": 1.0}},
     r"weights=\{'a': 1.0\} is unused by composition='lexicographic'"),
    ({"weights": {"strict": "1"}}, r"weights entry 'strict': '1' is not str -> number"),
    ({"curriculum": LengthCurriculum()}, r"curriculum is set but length='none'"),
])
def test_bad_fields_are_named(kwargs, message):
    with pytest.raises(ValueError, match=message):
        RewardSpec(**kwargs)


def test_missing_component_lists_what_exists():
    grades = binary([True], strict=[1.0])
    with pytest.raises(ValueError, match=r"\['flexible'\] that grades\[0\] lacks; it has "
                                         r"\['strict', 'task'\]"):
        RewardSpec(weights={"flexible": 1.0}).group_rewards(grades, [3])


def test_mismatched_lengths():
    with pytest.raises(ValueError, match=r"len\(lengths\)=1 != len\(grades\)=2"):
        RewardSpec(length="kimi").group_rewards(binary([True, False]), [3])


# --- gin ------------------------------------------------------------------------------------

def test_gin_scope_gives_each_suite_its_spec(clean_gin):
    gin.parse_config("""
        arith/RewardSpec.length = "kimi"
        arith/RewardSpec.length_weight = 0.5
        chat/RewardSpec.composition = "gated"
        chat/RewardSpec.gates = (("safety", 0.5),)
        chat/RewardSpec.gate_minimum = -1.0
    """)
    with gin.config_scope("arith"):
        arith = RewardSpec()
    with gin.config_scope("chat"):
        chat = RewardSpec()
    assert (arith.length, arith.length_weight, arith.composition) == ("kimi", 0.5, "sum")
    assert chat.gates == (("safety", 0.5),) and chat.gate_minimum == -1.0
    assert RewardSpec().is_identity  # unscoped: the default


def test_spec_is_hashable_and_compares_by_value():
    a = RewardSpec(weights={"strict": 0.75, "flexible": 0.25})
    b = RewardSpec(weights={"flexible": 0.25, "strict": 0.75})
    assert a == b and hash(a) == hash(b) and a != RewardSpec()
