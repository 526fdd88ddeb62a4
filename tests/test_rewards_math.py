"""Math grader: answer extraction, symbolic/numeric equivalence, adversarial inputs, time limit."""

import threading
import time

import pytest

from hcjax.rewards import math as math_grader
from hcjax.rewards.timelimit import TimeLimitExceeded, call_with_time_limit


@pytest.mark.parametrize("response, answer", [
    ("so the answer is \\boxed{\\frac{1}{2}}.", "\\frac{1}{2}"),
    ("<answer>$2\\sqrt{2}$</answer>", "2\\sqrt{2}"),
    ("<think>\\boxed{1}</think><answer>The value is \\boxed{4}</answer>", "4"),
    ("\\boxed{1} no, wait: \\boxed{\\{1, 2\\}}", "\\{1, 2\\}"),
    ("\\fbox{7}", "7"),
])
def test_extract_answer(response, answer):
    assert math_grader.extract_answer(response) == answer


@pytest.mark.parametrize("response", ["The answer is 3.", "\\boxed{\\frac{6}{2}", "<answer></answer>"])
def test_no_final_answer(response):
    grade = math_grader.grade(response, "3")
    assert grade.reward == 0.0 and "no final answer" in grade.reason


@pytest.mark.parametrize("answer, reference", [
    ("\\frac{1}{2}", "0.5"),                    # fraction vs decimal
    ("\\dfrac12", "1/2"),
    ("2\\sqrt{2}", "\\sqrt{8}"),                # radicals
    ("[1,3)", "[1, 3)"),                        # intervals
    ("(-\\infty, 2]", "(-\\infty,2]"),
    ("\\{3,2,1\\}", "\\{1,2,3\\}"),             # sets, any order
    ("2x+1=y", "y=2x+1"),                       # equations
    ("x=2", "2"),                               # an assignment to the variable asked for
    ("10\\text{ cm}", "10"),                    # units stripped
    ("\\$7.00", "7"),
    ("50\\%", "\\frac{1}{2}"),
    ("x^2-1", "(x-1)(x+1)"),                    # symbolic
    ("1,000", "1000"),
])
def test_equivalent_answers(answer, reference):
    assert math_grader.verify(f"Thus \\boxed{{{answer}}}", reference)


@pytest.mark.parametrize("answer, reference", [
    ("\\frac{1}{3}", "0.5"),
    ("2\\sqrt{3}", "\\sqrt{8}"),
    ("[1,3]", "[1,3)"),
    ("\\{1,2\\}", "\\{1,2,3\\}"),
    ("y=2x-1", "y=2x+1"),
    ("B", "A"),
])
def test_different_answers(answer, reference):
    assert not math_grader.verify(f"\\boxed{{{answer}}}", reference)


def test_last_answer_wins_over_hedging():
    assert math_grader.verify("\\boxed{1} or maybe \\boxed{2}", "2")
    assert not math_grader.verify("\\boxed{1} or maybe \\boxed{2}", "1")


def test_adversarial_inputs_are_wrong_not_errors():
    for response in ["\\boxed{}}}{{{\\frac", "\\boxed{\\frac{\\sqrt{}{}}", "\\boxed{" + "(" * 500 + "}",
                     "\\boxed{" + "1" * 2000 + "}", "<answer>\x00\x01</answer>"]:
        assert math_grader.grade(response, "1", timeout_s=1).reward == 0.0


def test_time_limit_stops_a_pathological_comparison():
    start = time.monotonic()
    grade = math_grader.grade("\\boxed{9^{9^{9^{9^{9}}}}}", "1", timeout_s=1)
    assert grade.reward == 0.0 and "exceeded" in grade.reason
    assert time.monotonic() - start < 10  # the comparison alone would run far longer


class _SlowToDelete:
    def __del__(self):  # an alarm raised in here is printed and dropped by Python
        end = time.monotonic() + 0.4
        while time.monotonic() < end:
            pass


def _outlive_the_limit():
    _SlowToDelete()  # deleted at once: the alarm fires inside __del__
    end = time.monotonic() + 5
    while time.monotonic() < end:
        pass
    return "ran to the end"


@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
def test_time_limit_survives_an_alarm_that_python_drops():
    start = time.monotonic()
    with pytest.raises(TimeLimitExceeded):
        call_with_time_limit(_outlive_the_limit, (), 0.1)
    assert time.monotonic() - start < 2  # the repeated alarm, not the 5 s loop, ended it
    assert call_with_time_limit(sum, ([1, 2],), 0.1) == 3
    time.sleep(0.3)  # disarmed: a stray repeat of the alarm would raise TimeLimitExceeded here


@pytest.mark.slow
def test_time_limit_works_off_the_main_thread():
    results = []

    def worker():
        results.append(math_grader.grade("\\boxed{0.5}", "1/2"))
        results.append(math_grader.grade("\\boxed{9^{9^{9^{9^{9}}}}}", "1", timeout_s=1))
        results.append(math_grader.grade("\\boxed{3}", "3"))

    thread = threading.Thread(target=worker)
    thread.start()
    thread.join(timeout=120)
    assert [g.reward for g in results] == [1.0, 0.0, 1.0]
    assert "exceeded" in results[1].reason


def test_bad_reference_is_an_error():
    with pytest.raises(ValueError, match="reference=''"):
        math_grader.grade("\\boxed{1}", "")
