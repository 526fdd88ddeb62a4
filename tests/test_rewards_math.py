"""Math grader: answer extraction, symbolic/numeric equivalence, adversarial inputs, time limit."""

import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from hcjax.rewards import math as math_grader
from hcjax.rewards.timelimit import TimeLimitExceeded, call_with_time_limit

REPO = Path(__file__).resolve().parent.parent


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


def _busy(seconds):
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        pass


class _SlowToDelete:
    def __del__(self):  # a raise in here would be printed and dropped by Python
        _busy(0.4)


def _outlive_the_limit():
    _SlowToDelete()  # deleted at once: the alarm comes due inside __del__
    _busy(5)
    return "ran to the end"


def test_time_limit_waits_out_a_del_and_then_stops_the_call():
    start = time.monotonic()
    with pytest.raises(TimeLimitExceeded):
        call_with_time_limit(_outlive_the_limit, (), 0.1)
    assert 0.35 < time.monotonic() - start < 2  # after __del__'s 0.4 s, not the 5 s loop
    assert call_with_time_limit(sum, ([1, 2],), 0.1) == 3
    time.sleep(0.3)  # disarmed: a stray repeat of the alarm would raise TimeLimitExceeded here


class _RaisesOnDelete:
    def __del__(self):
        raise ValueError("from __del__")


def _drop_an_exception_then_spin():
    _RaisesOnDelete()  # Python hands its ValueError to sys.unraisablehook
    _busy(5)


def test_time_limit_does_not_break_the_unraisable_hook(monkeypatch):
    seen = []

    def slow_hook(unraisable):  # the alarm comes due while the hook formats the exception
        _busy(0.4)
        seen.append(type(unraisable.exc_value).__name__)

    monkeypatch.setattr(sys, "unraisablehook", slow_hook)
    start = time.monotonic()
    with pytest.raises(TimeLimitExceeded):
        call_with_time_limit(_drop_an_exception_then_spin, (), 0.1)
    assert seen == ["ValueError"]  # the hook ran to its end
    assert 0.35 < time.monotonic() - start < 2


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


def test_a_climb_process_does_not_import_sympy_until_it_grades_math():
    """math-verify (and sympy under it) load on the first math comparison: a climb on arithmetic
    or code starts without them, and a grade still works."""
    code = ("import sys\nimport hcjax.rl.climber\nfrom hcjax.rewards import math as m\n"
            "before = 'sympy' in sys.modules\n"
            "print(before, m.grade('\\\\boxed{0.5}', '1/2').reward, 'sympy' in sys.modules)")
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True,
                          env={**os.environ, "JAX_PLATFORMS": "cpu"}, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.split() == ["False", "1.0", "True"]
