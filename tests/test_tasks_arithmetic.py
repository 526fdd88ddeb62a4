"""The synthetic arithmetic suite: correct answers, determinism, disjoint held-out split, the
grader's two extractions, and the problems themselves pinned (the climb's figures depend on them)."""

import hashlib
import json

import numpy as np
import pytest

from hcjax.data.template import normalize_answer, reasoning_response
from hcjax.tasks import TaskSuite, check_suite
from hcjax.tasks.arithmetic import ArithmeticSuite


def _eval(prompt):
    expr = prompt.rstrip("=")
    for op, fn in (("+", int.__add__), ("-", int.__sub__), ("*", int.__mul__), ("%", int.__mod__)):
        if op in expr:
            a, b = expr.split(op)
            return fn(int(a), int(b))
    raise AssertionError(prompt)


def thought(p):
    """The reasoning inside <think> of a problem's reference response."""
    return p.target.split("<think>", 1)[1].split("</think>", 1)[0]


def test_answers_are_correct_and_thought_is_reversed():
    suite = ArithmeticSuite(kinds=("add", "sub", "mul", "mod"), max_digits=4)
    for p in [*suite.heldout(), *(suite.train_problem(i) for i in range(300))]:
        assert int(p.reference) == _eval(p.prompt)
        assert p.target == reasoning_response(p.reference[::-1], p.reference)
        assert suite.grade(p, p.target).correct
        assert 1 <= p.meta["difficulty"] <= 4
        assert p.messages == ({"role": "user", "content": p.prompt},)


def test_is_a_task_suite():
    suite = ArithmeticSuite()
    assert isinstance(suite, TaskSuite)
    check_suite(suite)
    assert suite.tools(suite.train_problem(0)) is None
    assert set(suite.categories()) >= {suite.train_problem(i).category for i in range(50)}


def test_deterministic_and_seeded():
    a, b = ArithmeticSuite(seed=3), ArithmeticSuite(seed=3)
    assert a.heldout() == b.heldout()
    assert a.train_problem(17) == b.train_problem(17)
    assert ArithmeticSuite(seed=4).heldout() != a.heldout()


def test_heldout_disjoint_from_train():
    suite = ArithmeticSuite(min_digits=1, max_digits=2, num_heldout=100)
    held = {(p.meta["kind"], p.prompt) for p in suite.heldout()}
    train = {(p.meta["kind"], p.prompt) for p in (suite.train_problem(i) for i in range(3000))}
    assert not held & train
    assert len(train) > 500  # plenty of distinct training problems remain


def test_heldout_min_digits_keeps_the_fact_table_in_training():
    plain = ArithmeticSuite(kinds=("add", "sub"), min_digits=1, max_digits=2, num_heldout=200)
    multi = ArithmeticSuite(kinds=("add", "sub"), min_digits=1, max_digits=2, num_heldout=200,
                            heldout_min_digits=2)
    # Without it, a third of the ~155 single-digit facts never reach training.
    facts = {p.prompt for p in plain.heldout() if p.meta["difficulty"] == 1}
    assert len(facts) > 40
    held = multi.heldout()
    assert len(held) == 200 and all(p.meta["difficulty"] == 2 for p in held)
    assert held == ArithmeticSuite(kinds=("add", "sub"), min_digits=1, max_digits=2,
                                   num_heldout=200, heldout_min_digits=2).heldout()
    train = {p.prompt for p in (multi.train_problem(i) for i in range(4000))}
    assert not {p.prompt for p in held} & train
    # Every single-digit fact of the held-out-free stream appears in training.
    singles = {p.prompt for p in (multi.train_problem(i) for i in range(4000))
               if p.meta["difficulty"] == 1}
    assert len(singles) == 100 + 55  # a+b for a, b in 0..9; a-b for a >= b
    with pytest.raises(ValueError, match="heldout_min_digits=3"):
        ArithmeticSuite(min_digits=1, max_digits=2, heldout_min_digits=3)


def test_difficulty_knob():
    easy = ArithmeticSuite(min_digits=1, max_digits=1, kinds=("add",))
    hard = ArithmeticSuite(min_digits=5, max_digits=5, kinds=("add",))
    assert all(len(p.prompt) == 4 for p in easy.heldout())  # "a+b="
    assert all(p.prompt.index("+") == 5 for p in hard.heldout())


def test_grade_strict_and_flexible():
    suite = ArithmeticSuite(kinds=("add",), max_digits=1, num_heldout=4)
    p = suite.heldout()[0]
    right = suite.grade(p, f"<think>x</think><answer>{p.reference}</answer>")
    assert right.correct and right.components == {"strict": 1.0, "flexible": 1.0}
    assert suite.grade(p, f"<answer> 0{p.reference} </answer>").correct  # by value
    wrong = suite.grade(p, f"<answer>{int(p.reference) + 1}</answer>")
    assert not wrong.correct and wrong.reward == 0.0 and "differs from" in wrong.reason
    loose = suite.grade(p, f"<think>x</think>so {p.reference}")  # no answer block: wrong format
    assert not loose.correct and loose.components == {"strict": 0.0, "flexible": 1.0}
    assert loose.reason == "no answer (strict)"
    flexible = ArithmeticSuite(kinds=("add",), max_digits=1, num_heldout=4, extraction="flexible")
    assert flexible.grade(p, f"<think>x</think>{p.reference}").correct
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
        ({"extraction": "loose"}, "extraction='loose'"),
    ],
)
def test_bad_config(kwargs, match):
    with pytest.raises(ValueError, match=match):
        ArithmeticSuite(**kwargs)


def test_tiny_space_error():
    suite = ArithmeticSuite(kinds=("add",), min_digits=1, max_digits=1, num_heldout=2000)
    with pytest.raises(ValueError, match="outside the held-out set for index=0"):
        suite.train_problem(0)


# Pins: the problems as the suite generated them before data/tasks.ArithmeticSuite and
# tasks/arithmetic.ArithmeticTasks became this one suite (commit 9f07d34). The climb's recorded
# figures (README, docs) were measured on exactly these problems.

TINY_CPU = dict(kinds=("add", "sub"), min_digits=1, max_digits=2, thought="reversed",
                num_heldout=200, seed=0)  # configs/tiny_cpu.gin
PINNED = [
    ({}, "heldout", 0, ("sub-heldout-0", "sub:3x2", "993-37=", "956", "659", 3)),
    ({}, "heldout", 1, ("mul-heldout-1", "mul:3x1", "835*2=", "1670", "0761", 3)),
    ({}, "train", 0, ("mul-train-0", "mul:2x1", "56*2=", "112", "211", 2)),
    ({}, "train", 7, ("sub-train-7", "sub:2x2", "82-22=", "60", "06", 2)),
    (TINY_CPU, "heldout", 1, ("sub-heldout-1", "sub:2x1", "83-9=", "74", "47", 2)),
    (TINY_CPU, "train", 7, ("add-train-7", "add:2x2", "82+22=", "104", "401", 2)),
    (dict(kinds=("add", "sub", "mul", "mod"), max_digits=4, seed=3, num_heldout=50), "train", 0,
     ("mod-train-0", "mod:1x1", "1%3=", "1", "1", 1)),
    (dict(kinds=("add", "sub"), max_digits=2, thought="steps", short_fraction=0.3,
          num_heldout=50), "heldout", 1,
     ("sub-heldout-1", "sub:2x1", "83-9=", "74", "3-9-0=-6 8-0-1=7 47", 2)),
    (dict(kinds=("add", "sub"), max_digits=2, thought="recheck", short_fraction=0.2,
          num_heldout=50), "train", 7,
     ("add-train-7", "add:2x2", "82+22=", "104", "2+2+0=4 8+2+0=10 401", 2)),
    (dict(kinds=("add", "sub"), max_digits=2, heldout_min_digits=2, num_heldout=100), "train", 7,
     ("sub-train-7", "sub:1x1", "6-0=", "6", "6", 1)),
]


@pytest.mark.parametrize("kwargs, split, index, want", PINNED)
def test_pinned_problems(kwargs, split, index, want):
    suite = ArithmeticSuite(**kwargs)
    p = suite.heldout()[index] if split == "heldout" else suite.train_problem(index)
    pid, category, prompt, answer, reasoning, difficulty = want
    assert (p.id, p.category, p.prompt, p.reference, thought(p)) == (
        pid, category, prompt, answer, reasoning)
    assert p.meta == {"kind": pid.split("-")[0], "difficulty": difficulty}


@pytest.mark.parametrize("kwargs, digest", [
    ({}, "d587abf69ba3184db17cb9adb55d7d93224ffe1ecfd800901eb5c10d92ebba7f"),
    (TINY_CPU, "dca0673b30a1972284720fcc076d3b754a55eff692fa5b22aa30f88a0d3573c6"),
])
def test_pinned_streams(kwargs, digest):
    """The whole held-out split and the first 300 training problems, as a digest of their rows
    [id, category, prompt, answer, target, kind, difficulty]."""
    suite = ArithmeticSuite(**kwargs)
    rows = [[p.id, p.category, p.prompt, p.reference, p.target, p.meta["kind"],
             p.meta["difficulty"]]
            for p in [*suite.heldout(), *(suite.train_problem(i) for i in range(300))]]
    assert hashlib.sha256(json.dumps(rows).encode()).hexdigest() == digest


def test_pinned_sft_documents():
    """The SFT pipeline's arithmetic documents (tokens and loss masks of the first 60, after its
    shuffle) are the ones the tiny base was pre-trained on."""
    from hcjax.train.pipeline import DataConfig, build_documents

    docs = build_documents(DataConfig(num_train_problems=1000))
    h = hashlib.sha256()
    for i in range(60):
        h.update(np.asarray(docs[i]["tokens"]).tobytes())
        h.update(np.asarray(docs[i]["loss_mask"]).tobytes())
    assert h.hexdigest() == "79f196b9cca870efca6634476903585840b91394635341508a6eed2cdfd53532"
