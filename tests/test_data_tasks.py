"""The synthetic arithmetic suite: correct answers, determinism, disjoint held-out split."""

import pytest

from hcjax.data.tasks import ArithmeticSuite, Problem, normalize_answer
from hcjax.data.template import reasoning_response


def _eval(prompt):
    expr = prompt.rstrip("=")
    for op, fn in (("+", int.__add__), ("-", int.__sub__), ("*", int.__mul__), ("%", int.__mod__)):
        if op in expr:
            a, b = expr.split(op)
            return fn(int(a), int(b))
    raise AssertionError(prompt)


def test_answers_are_correct_and_thought_is_reversed():
    suite = ArithmeticSuite(kinds=("add", "sub", "mul", "mod"), max_digits=4)
    for p in suite.heldout() + [suite.train_problem(i) for i in range(300)]:
        assert int(p.answer) == _eval(p.prompt)
        assert p.thought == p.answer[::-1]
        assert p.check(p.target())
        assert 1 <= p.difficulty <= 4


def test_deterministic_and_seeded():
    a, b = ArithmeticSuite(seed=3), ArithmeticSuite(seed=3)
    assert a.heldout() == b.heldout()
    assert a.train_problem(17) == b.train_problem(17)
    assert ArithmeticSuite(seed=4).heldout() != a.heldout()


def test_heldout_disjoint_from_train():
    suite = ArithmeticSuite(min_digits=1, max_digits=2, num_heldout=100)
    held = {(p.kind, p.prompt) for p in suite.heldout()}
    train = {(p.kind, p.prompt) for p in (suite.train_problem(i) for i in range(3000))}
    assert not held & train
    assert len(train) > 500  # plenty of distinct training problems remain


def test_heldout_min_digits_keeps_the_fact_table_in_training():
    plain = ArithmeticSuite(kinds=("add", "sub"), min_digits=1, max_digits=2, num_heldout=200)
    multi = ArithmeticSuite(kinds=("add", "sub"), min_digits=1, max_digits=2, num_heldout=200,
                            heldout_min_digits=2)
    # Without it, a third of the ~155 single-digit facts never reach training.
    facts = {p.prompt for p in plain.heldout() if p.difficulty == 1}
    assert len(facts) > 40
    held = multi.heldout()
    assert len(held) == 200 and all(p.difficulty == 2 for p in held)
    assert held == multi.heldout()  # deterministic
    train = {p.prompt for p in (multi.train_problem(i) for i in range(4000))}
    assert not {p.prompt for p in held} & train
    # Every single-digit fact of the held-out-free stream appears in training.
    singles = {p.prompt for p in (multi.train_problem(i) for i in range(4000))
               if p.difficulty == 1}
    assert len(singles) == 100 + 55  # a+b for a, b in 0..9; a-b for a >= b
    with pytest.raises(ValueError, match="heldout_min_digits=3"):
        ArithmeticSuite(min_digits=1, max_digits=2, heldout_min_digits=3)


def test_difficulty_knob():
    easy = ArithmeticSuite(min_digits=1, max_digits=1, kinds=("add",))
    hard = ArithmeticSuite(min_digits=5, max_digits=5, kinds=("add",))
    assert all(len(p.prompt) == 4 for p in easy.heldout())  # "a+b="
    assert all(p.prompt.index("+") == 5 for p in hard.heldout())


def test_check():
    p = Problem("x", "2+2=", "4")
    assert p.check(reasoning_response("", "4"))
    assert p.check("<answer> 04 </answer>")
    assert not p.check("<answer>5</answer>")
    assert not p.check("4")  # no answer block: wrong format
    assert normalize_answer("1,000") == "1000"
    assert normalize_answer("a  b") == "a b"


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"kinds": ("pow",)}, "kinds"),
        ({"kinds": ()}, "kinds"),
        ({"min_digits": 3, "max_digits": 2}, "min_digits=3"),
        ({"thought": "cot"}, "thought='cot'"),
        ({"num_heldout": -1}, "num_heldout=-1"),
    ],
)
def test_bad_config(kwargs, match):
    with pytest.raises(ValueError, match=match):
        ArithmeticSuite(**kwargs)


def test_tiny_space_error():
    suite = ArithmeticSuite(kinds=("add",), min_digits=1, max_digits=1, num_heldout=2000)
    with pytest.raises(ValueError, match="too small"):
        suite.train_problem(0)
