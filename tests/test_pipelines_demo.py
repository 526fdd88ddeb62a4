"""The long2short demonstration's pieces: the long "steps" thought of the arithmetic suite
(exact working, defaults untouched, the long/short mix), and DPO pairs from rejection
sampling's samples.jsonl."""

import json

import pytest

from hcjax.distill.dpo import DPOConfig, pairs_from_samples
from hcjax.distill.rejection import Sample, sample_records
from hcjax.tasks.arithmetic import ArithmeticSuite, operands, recheck_thought, steps_thought
from hcjax.tasks.base import TaskProblem


def thought(p):
    """The reasoning inside <think> of a problem's reference response."""
    return p.target.split("<think>", 1)[1].split("</think>", 1)[0]


def test_steps_thought_exact():
    assert steps_thought("add", 47, 85) == "7+5+0=12 4+8+1=13 231"
    assert steps_thought("add", 5, 7) == "5+7+0=12 21"
    assert steps_thought("add", 90, 3) == "0+3+0=3 9+0+0=9 39"
    # Borrows: a negative column value v gives digit v mod 10 and a borrow into the next column.
    assert steps_thought("sub", 103, 8) == "3-8-0=-5 0-0-1=-1 1-0-1=0 59"
    assert steps_thought("sub", 100, 99) == "0-9-0=-9 0-9-1=-10 1-0-1=0 1"
    assert steps_thought("sub", 9, 9) == "9-9-0=0 0"
    assert steps_thought("mul", 47, 8) == "7*8+0=56 4*8+5=37 673"
    assert steps_thought("mod", 47, 5) == "47=9*5+2 2"


def test_steps_thought_ends_with_the_reversed_answer():
    suite = ArithmeticSuite(kinds=("add", "sub", "mul", "mod"), max_digits=3, thought="steps")
    for i in range(300):
        p = suite.train_problem(i)
        assert thought(p).split(" ")[-1] == p.reference[::-1]
        assert suite.grade(p, p.target).correct


def test_recheck_thought_repeats_the_working():
    assert recheck_thought("add", 47, 85) == "7+5+0=12 4+8+1=13 231 check 7+5+0=12 4+8+1=13 231"
    suite = ArithmeticSuite(kinds=("add", "sub"), max_digits=2, thought="recheck",
                            short_fraction=0.2)
    ps = [suite.train_problem(i) for i in range(500)]
    short = [p for p in ps if " check " not in thought(p)]
    assert 0.14 < len(short) / len(ps) < 0.26
    for p in ps:
        a, b = map(int, operands(p))
        steps = steps_thought(p.meta["kind"], a, b)
        assert thought(p) == (steps if p in short else f"{steps} check {steps}")
        assert suite.grade(p, p.target).correct
    # The long form is the short one plus a redundant second pass: more than twice its length.
    assert (sum(len(thought(p)) for p in ps if p not in short) / (len(ps) - len(short))
            > 2 * sum(len(thought(p)) for p in short) / len(short))


def test_steps_keeps_the_problems_and_the_default():
    base = ArithmeticSuite(kinds=("add", "sub"), max_digits=2, num_heldout=50)
    steps = ArithmeticSuite(kinds=("add", "sub"), max_digits=2, num_heldout=50, thought="steps",
                            short_fraction=0.2)
    for a, b in zip([base.train_problem(i) for i in range(100)] + base.heldout(),
                    [steps.train_problem(i) for i in range(100)] + steps.heldout(), strict=True):
        assert (a.id, a.prompt, a.reference) == (b.id, b.prompt, b.reference)
        assert thought(a) == a.reference[::-1]  # the default thought is unchanged
    assert ArithmeticSuite().thought == "reversed" and ArithmeticSuite().short_fraction == 0.0


def test_short_fraction_mix():
    def short_share(fraction):
        s = ArithmeticSuite(kinds=("add", "sub"), max_digits=2, thought="steps",
                            short_fraction=fraction)
        ps = [s.train_problem(i) for i in range(2000)]
        return sum(thought(p) == p.reference[::-1] for p in ps) / len(ps), ps

    share, ps = short_share(0.2)
    assert 0.17 < share < 0.23
    assert short_share(0.2)[1] == ps  # fixed per problem id
    assert short_share(0.0)[0] == 0.0 and short_share(1.0)[0] == 1.0


@pytest.mark.parametrize("kwargs, match", [
    ({"thought": "steps", "short_fraction": 1.5}, "short_fraction=1.5"),
    ({"thought": "reversed", "short_fraction": 0.2}, "unless thought is 'steps' or 'recheck'"),
    ({"thought": "long"}, "thought='long'"),
])
def test_bad_steps_config(kwargs, match):
    with pytest.raises(ValueError, match=match):
        ArithmeticSuite(**kwargs)


def test_dpo_pairs_from_rejection_samples(tmp_path):
    problems = [TaskProblem("p0", "3", ({"role": "user", "content": "1+2="},)),
                TaskProblem("p1", "9", ({"role": "user", "content": "4+5="},))]
    samples = [[Sample("long3", 20, True), Sample("short3", 8, True), Sample("bad", 8, False),
                Sample("mid3", 11, True), Sample("", 1, False)],
               [Sample("x", 9, False), Sample("y", 20, False)]]
    records = sample_records(problems, samples)
    assert records[0]["id"] == "p0" and records[0]["messages"] == [
        {"role": "user", "content": "1+2="}]
    assert records[0]["samples"][1] == {"text": "short3", "length": 8, "correct": True}
    path = tmp_path / "samples.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    pairs = pairs_from_samples(str(path), DPOConfig())
    # Problem 0: chosen short3 (8); long3 (20 >= 12) and the wrong one rejected, mid3 (11 < 12)
    # not, the empty sample left out. Problem 1: nothing correct, no pair.
    assert [(p.chosen, p.rejected, p.chosen_len, p.rejected_len) for p in pairs] == [
        ("short3", "long3", 8, 20), ("short3", "bad", 8, 8)]
    assert pairs[0].prompt == ({"role": "user", "content": "1+2="},) and pairs[0].task_id == "p0"
    assert len(pairs_from_samples(str(path), DPOConfig(max_pairs_per_group=1))) == 1
    path.write_text('{"messages": "x"}\n')
    with pytest.raises(ValueError, match="samples.jsonl:1"):
        pairs_from_samples(str(path), DPOConfig())


def test_demo_script_parses_and_its_configs_bind():
    """launch/pipelines_demo.sh (about 42 minutes, run by hand): valid bash, and each gin file it
    names binds."""
    import re
    import subprocess
    from pathlib import Path

    from hcjax import config

    script = Path(__file__).resolve().parents[1] / "launch" / "pipelines_demo.sh"
    assert subprocess.run(["bash", "-n", str(script)], capture_output=True).returncode == 0
    names = sorted(set(re.findall(r"--gin_file (\S+\.gin)", script.read_text())))
    assert "long2short_tiny.gin" in names and "consolidate_tiny.gin" in names
    for name in names:
        config.bind([name], ["ArithmeticSuite.heldout_min_digits = 2"])
