"""The synthetic code suite: formats and lengths, determinism, held-out split disjoint from
training, reference programs passing in the sandbox, wrong programs failing with a reason, and
sandbox infrastructure failures giving aborted grades."""

import dataclasses
import time

import pytest

from hcjax import sandbox
from hcjax.data.template import prompt_ids
from hcjax.data.tokenizer import ByteTokenizer
from hcjax.rewards import code as code_reward
from hcjax.tasks.base import TaskSuite, check_suite
from hcjax.tasks.code import CodeSuite, reference_program

needs_sandbox = pytest.mark.skipif(
    sandbox.run(["true"], timeout_s=10, memory_mb=64).aborted,
    reason="this machine cannot make sandbox namespaces")


def _key(p):
    return p.meta["kind"], p.meta["coefficients"]


def test_is_a_task_suite_with_documented_formats():
    suite = CodeSuite()
    check_suite(suite)
    assert isinstance(suite, TaskSuite)
    assert suite.name == "code"
    assert suite.categories() == ["affine:1d", "poly2:1d", "mod:1d"]
    p = suite.train_problem(0)
    assert p.messages == ({"role": "user", "content": p.prompt},)
    assert p.prompt.startswith("f(x)=")
    assert p.target.startswith("```\ndef f(x):return ") and p.target.endswith("\n```")
    assert code_reward.extract_program(p.target) == p.target[4:-3]
    assert reference_program("3*x-4") == "```\ndef f(x):return 3*x-4\n```"


def test_rendering_of_each_kind():
    suite = CodeSuite(kinds=("affine", "poly2", "mod"), min_digits=1, max_digits=2)
    seen = {}
    for i in range(300):
        p = suite.train_problem(i)
        seen.setdefault(p.meta["kind"], p)
    a, b = seen["affine"].meta["coefficients"]
    assert seen["affine"].prompt == f"f(x)={a}x{b:+d}"
    assert seen["affine"].target == reference_program(f"{a}*x{b:+d}")
    a, b, c = seen["poly2"].meta["coefficients"]
    assert seen["poly2"].prompt == f"f(x)={a}x^2{b:+d}x{c:+d}"
    assert seen["poly2"].target == reference_program(f"{a}*x**2{b:+d}*x{c:+d}")
    a, b, m = seen["mod"].meta["coefficients"]
    assert seen["mod"].prompt == f"f(x)={a}x{b:+d} mod {m}"
    assert seen["mod"].target == reference_program(f"({a}*x{b:+d})%{m}")


def _by_hand(kind, coefs, x):
    if kind == "poly2":
        return coefs[0] * x**2 + coefs[1] * x + coefs[2]
    return (coefs[0] * x + coefs[1]) % coefs[2] if kind == "mod" else coefs[0] * x + coefs[1]


def test_hidden_tests_match_the_function():
    suite = CodeSuite(max_digits=2, num_tests=6)
    for p in [*suite.heldout()[:30], *(suite.train_problem(i) for i in range(30))]:
        inputs, kind, coefs = p.meta["inputs"], p.meta["kind"], p.meta["coefficients"]
        assert len(set(inputs)) == 6 and all(-20 <= x <= 20 for x in inputs)
        assert p.reference.call == "[" + ",".join(f"f({x})" for x in inputs) + "]"
        assert p.reference.expected == str([_by_hand(kind, coefs, x) for x in inputs]).replace(
            " ", "")


def test_deterministic_and_seeded():
    a, b = CodeSuite(seed=3, max_digits=2), CodeSuite(seed=3, max_digits=2)
    assert a.heldout() == b.heldout()
    assert [a.train_problem(i) for i in range(20)] == [b.train_problem(i) for i in range(20)]
    assert CodeSuite(seed=4, max_digits=2).heldout() != a.heldout()


def test_heldout_disjoint_from_train():
    suite = CodeSuite(kinds=("affine",), num_heldout=40)  # 8 x 18 = 144 affine functions
    held = {_key(p) for p in suite.heldout()}
    assert len(suite.heldout()) == 40
    train = [suite.train_problem(i) for i in range(2000)]
    assert not held & {_key(p) for p in train}
    assert len({_key(p) for p in train}) == 144 - len(held)
    assert len({p.id for p in suite.heldout()}) == 40


def test_lengths_fit_the_tiny_engine():
    tok = ByteTokenizer()
    suite = CodeSuite(min_digits=1, max_digits=2)
    problems = [*suite.heldout(), *(suite.train_problem(i) for i in range(2000))]
    longest_prompt = max(len(prompt_ids(p.prompt, tok)) for p in problems)
    longest_target = max(len(tok.encode(p.target)) + 1 for p in problems)  # + <|end|>
    assert longest_prompt <= 32, longest_prompt
    assert longest_target <= 48, longest_target


def test_heldout_min_digits_holds_out_the_harder_half_only():
    suite = CodeSuite(max_digits=2, heldout_min_digits=2, num_heldout=150)
    held = suite.heldout()
    assert len(held) == 150 and {p.category for p in held} == {"affine:2d", "poly2:2d", "mod:2d"}
    train = [suite.train_problem(i) for i in range(600)]
    assert {p.category for p in train} == set(suite.categories())  # 1d and 2d alike
    assert not {_key(p) for p in held} & {_key(p) for p in train}


@pytest.mark.parametrize("kwargs, match", [
    ({"heldout_min_digits": 2}, "heldout_min_digits=2"),
    ({"max_digits": 3, "min_digits": 2, "heldout_min_digits": 1}, "heldout_min_digits=1"),
    ({"kinds": ("affine", "cubic")}, "kinds="),
    ({"kinds": ()}, "kinds="),
    ({"min_digits": 0}, "min_digits=0"),
    ({"min_digits": 3, "max_digits": 2}, "max_digits=2"),
    ({"num_tests": 2}, "num_tests=2"),
    ({"test_range": 1}, "test_range=1"),
    ({"num_heldout": -1}, "num_heldout=-1"),
    ({"timeout_s": 0}, "timeout_s=0"),
])
def test_bad_config_is_named(kwargs, match):
    with pytest.raises(ValueError, match=match):
        CodeSuite(**kwargs)


def test_bad_index_and_foreign_reference():
    suite = CodeSuite()
    with pytest.raises(ValueError, match="index=-1"):
        suite.train_problem(-1)
    p = dataclasses.replace(suite.train_problem(0), reference="7")
    with pytest.raises(ValueError, match="not a CallTest"):
        suite.grade(p, p.target)


def test_no_program_is_wrong_without_the_sandbox(monkeypatch):
    def fail(*args, **kwargs):
        raise AssertionError("the sandbox must not run without a program")

    monkeypatch.setattr(sandbox, "run", fail)
    suite = CodeSuite()
    g = suite.grade(suite.train_problem(0), "def f(x):return x")  # no fence
    assert g.reward == 0.0 and not g.correct and not g.aborted
    assert "no ```python fenced program" in g.reason


def test_sandbox_failure_is_aborted_not_zero(monkeypatch):
    def broken(*args, **kwargs):
        return sandbox.Outcome(sandbox.INFRA_ERROR, "", "", None, 0.0, "namespace set-up failed")

    monkeypatch.setattr(sandbox, "run", broken)
    suite = CodeSuite()
    p = suite.train_problem(0)
    g = suite.grade(p, p.target)
    assert g.aborted and not g.correct
    assert "sandbox failure" in g.reason


@needs_sandbox
def test_heldout_targets_pass_and_wrong_programs_fail_in_the_sandbox():
    suite = CodeSuite(min_digits=1, max_digits=2, num_heldout=24)
    start = time.monotonic()
    for p in suite.heldout():
        g = suite.grade(p, p.target)
        assert g.correct and g.reward == 1.0 and not g.aborted, (p.prompt, g.reason)
        assert g.components == {"correct": 1.0}
    per_grade = (time.monotonic() - start) / len(suite.heldout())
    assert per_grade < 2.0, per_grade  # one sandbox run per response (~0.05 s here)

    by_kind = {p.meta["kind"]: p for p in suite.heldout()}
    wrong = {
        "affine": "```\ndef f(x):return x\n```",
        "poly2": "```py\ndef f(x):\n    return 0\n```",
        # Python's % binds tighter than +: the spec's "mod" needs parentheses.
        "mod": reference_program("{}*x{:+d}%{}".format(*by_kind["mod"].meta["coefficients"])),
    }
    for kind, response in wrong.items():
        g = suite.grade(by_kind[kind], response)
        assert g.reward == 0.0 and not g.correct and not g.aborted, (kind, g.reason)
        assert "failed" in g.reason and "(got [" in g.reason  # the wrong outputs are shown
    crash = suite.grade(by_kind["affine"], "```\ndef f(x):return 1/0\n```")
    assert crash.reward == 0.0 and not crash.aborted and "ZeroDivisionError" in crash.reason


@pytest.mark.slow
@needs_sandbox
def test_every_default_heldout_target_passes_in_the_sandbox():
    suite = CodeSuite(max_digits=2)  # 100 problems, ~0.05-0.15 s each
    grades = [suite.grade(p, p.target) for p in suite.heldout()]
    assert all(g.correct and not g.aborted for g in grades), [g.reason for g in grades]
