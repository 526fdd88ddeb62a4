"""ReasoningGymSuite over three reasoning-gym datasets: held-out and training questions disjoint
over many draws, grades equal to each dataset's own scorer (through reasoning-gym's own answer
extraction) on correct, partial, wrong and malformed responses, categories with difficulty,
determinism by seed, one-line errors for bad names and configs, gin, and the lazy import."""

import collections
import dataclasses
import re
import subprocess
import sys
from pathlib import Path

import gin
import pytest
import reasoning_gym
from reasoning_gym.utils import extract_answer

from hcjax.tasks import ArithmeticSuite, MixtureSuite, ReasoningGymSuite, check_suite
from hcjax.tasks import reasoning_gym as rg_suite
from hcjax.tasks.reasoning_gym import EXTRACTIONS

ROOT = Path(__file__).resolve().parent.parent

# Small problem spaces on purpose: chain_sum with two one-digit terms has 200 questions, so a
# held-out split of 40 catches a training draw in about one of five and the redraw path runs.
DATASETS = {
    "basic_arithmetic": {"config": {"min_terms": 2, "max_terms": 3, "min_digits": 1,
                                    "max_digits": 1, "operators": ["+", "-"],
                                    "allow_parentheses": False, "allow_negation": False}},
    "chain_sum": {"weight": 2.0, "config": {"min_terms": 2, "max_terms": 2, "max_digits": 1}},
    "leg_counting": {"config": {"min_animals": 1, "max_animals": 2, "max_instances": 3}},
}


def make(**kwargs):
    return ReasoningGymSuite(**{"datasets": DATASETS, "num_heldout": 40, **kwargs})


@pytest.fixture(scope="module")
def suite():
    return make()


def question(suite, problem):
    return suite.entry(problem)[1]["question"]


def first_line(excinfo):
    """Our message: gin appends its own "In call to configurable" line below it."""
    return str(excinfo.value).splitlines()[0]


# Splits ----------------------------------------------------------------------------------------

def test_heldout_and_training_questions_are_disjoint_over_many_draws(suite):
    held = [question(suite, p) for p in suite.heldout()]
    assert len(held) == 3 * 40 and len(set(held)) == len(held)  # distinct within the split
    draws = [suite.train_problem(i) for i in range(5000)]
    assert not {question(suite, p) for p in draws} & set(held)
    # The redraw path ran (without it those indices would have served a held-out question), and
    # a redrawn problem is none of the neighbouring indices' problems.
    redrawn = [p for p in draws if p.meta["attempt"] > 0]
    assert len(redrawn) > 100
    first = suite._make(suite._by_label["chain_sum"], "train", 0, redrawn[0].meta["position"], "x")
    assert first[1] in set(held)
    assert len({p.id for p in draws}) == len(draws)


def test_dataset_shares_follow_the_weights_and_heldout_is_interleaved(suite):
    counts = collections.Counter(suite.train_problem(i).meta["label"] for i in range(4000))
    assert abs(counts["chain_sum"] / 4000 - 0.5) < 0.04
    assert abs(counts["leg_counting"] / 4000 - 0.25) < 0.04
    labels = [p.meta["label"] for p in suite.heldout()[:6]]
    assert labels == ["basic_arithmetic", "chain_sum", "leg_counting"] * 2
    uneven = make(datasets={**DATASETS, "chain_sum": {**DATASETS["chain_sum"], "num_heldout": 2}})
    assert collections.Counter(p.meta["label"] for p in uneven.heldout()) == {
        "basic_arithmetic": 40, "chain_sum": 2, "leg_counting": 40}


def test_deterministic_by_seed():
    a, b = make(seed=5), make(seed=5)
    order = [311, 7, 4999, 0, 42]  # an index gives one problem, whatever was drawn before
    assert {i: a.train_problem(i) for i in order} == {i: b.train_problem(i) for i in sorted(order)}
    assert a.heldout() == b.heldout()
    other = make(seed=6)
    assert other.heldout() == a.heldout()  # the held-out split has its own seed
    assert [other.train_problem(i).prompt for i in range(50)] != [
        a.train_problem(i).prompt for i in range(50)]
    assert [p.prompt for p in make(heldout_seed=9).heldout()] != [p.prompt for p in a.heldout()]


# Grading ---------------------------------------------------------------------------------------

def _responses(reference):
    wrong = str(int(reference) + 1)
    return {
        "correct": f"<answer>{reference}</answer>",
        "correct, spaced, last": f"<answer>{wrong}</answer> no: <answer> {reference} </answer>",
        "wrong": f"<answer>{wrong}</answer>",
        "wrong, after the right one": f"<answer>{reference}</answer> no: <answer>{wrong}</answer>",
        "partial": f"<answer>{reference} legs</answer>",
        "empty": "<answer></answer>",
        "untagged": f"2 + 2 = 4, so the answer is {reference}.",
        "untagged, wrong": f"The answer is {wrong}",
        "unclosed": f"<answer>{reference}",
        "no answer": "I do not know.",
    }


def _expected(response, extraction):
    """The answer each extraction reads, by reasoning-gym's own tag extraction (and for flexible,
    the last integer: every answer of these datasets is one)."""
    tagged = extract_answer(response)
    numbers = re.findall(r"-?\d+", response)
    flexible = tagged if tagged is not None else (numbers[-1] if numbers else None)
    return {"strict": tagged, "flexible": flexible}


@pytest.mark.parametrize("extraction", EXTRACTIONS)
@pytest.mark.parametrize("name", sorted(DATASETS))
def test_grades_equal_the_datasets_own_scorer(suite, name, extraction):
    graded = dataclasses.replace(suite, extraction=extraction)
    scorer = reasoning_gym.get_score_answer_fn(name)  # a dataset object of reasoning-gym's own
    problems = [p for p in suite.heldout() if p.meta["label"] == name][:10]
    problems += [p for p in (suite.train_problem(i) for i in range(200))
                 if p.meta["label"] == name][:10]
    seen = collections.Counter()
    for p in problems:
        entry = graded.entry(p)[1]
        assert p.reference == entry["answer"] and entry["question"].strip() in p.prompt
        for kind, response in _responses(p.reference).items():
            answers = _expected(response, extraction)
            scores = {m: scorer(a, entry) for m, a in answers.items()}
            want = scores[extraction]
            g = graded.grade(p, response)
            assert g.reward == want, (p.id, kind, response, g)
            assert g.correct == (want == 1.0)
            assert g.components == {"score": want, "format": float(answers["strict"] is not None),
                                    "strict": float(scores["strict"] == 1.0),
                                    "flexible": float(scores["flexible"] == 1.0)}
            label = g.reason.split(":", 1)[0]
            assert label == ("malformed" if answers[extraction] is None else
                             "correct" if want == 1.0 else "wrong"), (kind, g.reason)
            seen[kind, label, 0 < want < 1] += 1
        assert graded.grade(p, p.target).correct
    n = len(problems)
    assert seen["correct", "correct", False] == seen["correct, spaced, last", "correct", False] == n
    assert seen["wrong", "wrong", False] == seen["no answer", "malformed", False] == n
    assert seen["untagged", "malformed" if extraction == "strict" else "correct", False] == n
    # A partial score is a reward but not a success (pass@1 counts `correct`).
    if name == "basic_arithmetic":
        assert seen["partial", "wrong", True] == n


def test_answer_format_and_prompt_are_fields():
    boxed = make(answer_format="\\boxed{{answer}}", system_prompt="Be brief.",
                 prompt_template="Q: {question} ({format})")
    p = boxed.heldout()[0]
    assert p.messages[0] == {"role": "system", "content": "Be brief."}
    assert p.prompt.startswith("Q: Calculate ") and p.prompt.endswith("(\\boxed{...})")
    assert p.target == f"\\boxed{{{p.reference}}}"
    assert boxed.grade(p, f"so \\boxed{{0}} or \\boxed{{{p.reference}}}").correct
    assert boxed.grade(p, f"<answer>{p.reference}</answer>").reason.startswith("malformed")
    line = make(answer_format="Answer: {answer}")
    p = line.heldout()[0]
    assert line.grade(p, f"Answer: 1\nthen\nAnswer: {p.reference}\nbye").correct
    default = make().heldout()[0]
    assert default.prompt.endswith("\nGive your final answer as <answer>...</answer>.")
    assert default.target == f"<answer>{default.reference}</answer>"


def test_problems_of_another_configuration_are_refused(suite):
    p = make(seed=3).train_problem(0)
    with pytest.raises(ValueError, match="not a problem of suite"):
        make(datasets={"chain_sum": DATASETS["chain_sum"]}).grade(p, p.target)
    q = make(heldout_seed=3).heldout()[0]
    with pytest.raises(ValueError, match="its prompt differs"):
        suite.grade(q, q.target)


# Categories ------------------------------------------------------------------------------------

def test_categories_carry_the_difficulty_the_metadata_gives(suite):
    # basic_arithmetic draws 2..3 terms of one digit (num_digits has one level: no category),
    # chain_sum two terms of one digit (none), leg_counting 1..2 animals.
    assert list(suite.categories()) == [
        "basic_arithmetic:num_terms=2", "basic_arithmetic:num_terms=3", "chain_sum",
        "leg_counting:num_animals=1", "leg_counting:num_animals=2"]
    for p in [*suite.heldout(), *(suite.train_problem(i) for i in range(300))]:
        metadata = suite.entry(p)[1]["metadata"]
        assert p.meta["difficulty"] == {k: metadata[k] for k in p.meta["difficulty"]}
        assert p.category.split(":")[0] == p.meta["label"] == p.meta["dataset"]
    groups, shares = suite.category_shares()
    assert groups["chain_sum"] == "chain_sum" and shares == {
        "basic_arithmetic": 1.0, "chain_sum": 2.0, "leg_counting": 1.0}
    p, cursor = suite.next_in_category("leg_counting:num_animals=2", 0)
    assert p.category == "leg_counting:num_animals=2" and cursor > 0


def test_difficulty_keys_and_labels_can_be_chosen():
    chosen = ReasoningGymSuite(num_heldout=5, datasets={
        "legs": {"dataset": "leg_counting", "difficulty": [],
                 "config": {"max_animals": 3, "min_animals": 1}},
        "sums": {"dataset": "chain_sum", "difficulty": ["num_digits"],
                 "config": {"max_terms": 2, "max_digits": 2}},
        "held_only": {"dataset": "chain_sum", "weight": 0, "config": {"max_terms": 2}}})
    assert list(chosen.categories()) == ["legs", "sums:num_digits=1", "sums:num_digits=2"]
    assert len(chosen.heldout()) == 15 and chosen.heldout()[2].meta["label"] == "held_only"
    assert chosen.train_problem(0).id.split(":")[:2] in (["legs", "train"], ["sums", "train"])


def test_is_a_task_suite_and_works_in_a_mixture(suite):
    check_suite(suite)
    assert suite.tools(suite.heldout()[0]) is None
    mix = MixtureSuite(suites=[suite, ArithmeticSuite(num_heldout=5)])
    rg_problems = [p for p in mix.heldout() if p.id.startswith("reasoning_gym/")]
    assert len(rg_problems) == 120
    for p in [*rg_problems[:5], *(mix.train_problem(i) for i in range(20))]:
        assert mix.grade(p, p.target).correct


# Errors ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("datasets, words", [
    ({"chain_sums": {}}, ["'chain_sums'", "close matches: ['chain_sum'"]),
    ({"x": {"dataset": "leg_count"}}, ["'leg_count'", "'leg_counting'"]),
    ({"chain_sum": {"config": {"max_term": 3}}}, ["['max_term']", "ChainSumConfig",
                                                  "'max_terms'"]),
    ({"chain_sum": {"config": {"min_terms": 5, "max_terms": 2}}},
     ["rejects config={'min_terms': 5, 'max_terms': 2}", "max_terms must be >= min_terms"]),
    ({"chain_sum": {"config": {"seed": 3}}}, ["config sets 'seed'"]),
    ({"chain_sum": {"weights": 2}}, ["unknown keys ['weights']", "'weight'"]),
    ({"chain_sum": {"weight": -1}}, ["weight=-1"]),
    ({"chain_sum": {"weight": 0}}, ["positive sum"]),
    ({"chain_sum": {"difficulty": ["num_legs"]}}, ["['num_legs']", "'num_terms'"]),
    ({"chain_sum": {"num_heldout": -2}}, ["num_heldout=-2"]),
    ({"a/b": {"dataset": "chain_sum"}}, ["'a/b'", "without '/'"]),
    ({"chain_sum": 3}, ["['chain_sum']=3", "mapping"]),
    ({}, ["datasets={}", "non-empty"]),
])
def test_bad_names_and_configs_are_one_line_errors(datasets, words):
    with pytest.raises(ValueError) as excinfo:
        ReasoningGymSuite(datasets=datasets)
    message = first_line(excinfo)
    for w in words:
        assert w in message, message


@pytest.mark.parametrize("kwargs, words", [
    ({"answer_format": "<answer></answer>"}, ["answer_format='<answer></answer>'"]),
    ({"answer_format": "{answer}"}, ["non-empty prefix"]),
    ({"prompt_template": "{question} {oops}"}, ["prompt_template", "'oops'"]),
    ({"prompt_template": "no question"}, ["no {question}"]),
    ({"num_heldout": -1}, ["num_heldout=-1"]),
    ({"extraction": "loose"}, ["extraction='loose'", "('strict', 'flexible')"]),
])
def test_bad_suite_fields_are_one_line_errors(kwargs, words):
    with pytest.raises(ValueError) as excinfo:
        make(**kwargs)
    for w in words:
        assert w in first_line(excinfo)


def test_too_few_distinct_questions_for_the_heldout_split():
    tiny = ReasoningGymSuite(num_heldout=150, datasets={
        "products": {"config": {"min_digits": 1, "max_digits": 1}}})  # 10 x 10 questions
    with pytest.raises(ValueError, match=r"\['products'\] gives only 100 distinct questions"):
        tiny.heldout()
    every = ReasoningGymSuite(num_heldout=100, datasets={
        "products": {"config": {"min_digits": 1, "max_digits": 1}}})
    with pytest.raises(ValueError, match="were all held-out questions"):
        every.train_problem(0)


def test_missing_reasoning_gym_is_a_clear_import_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "reasoning_gym", None)  # what an uninstalled package gives
    with pytest.raises(ImportError, match="pip install -r requirements-real.txt"):
        make()
    assert rg_suite.INSTALL_HINT.startswith("reasoning-gym is not installed")


def test_imported_lazily_and_without_jax():
    code = ("import sys, hcjax.tasks as t\nlazy = 'reasoning_gym' not in sys.modules\n"
            "t.ReasoningGymSuite(datasets={'chain_sum': {}}).train_problem(0)\n"
            "sys.exit(0 if lazy and 'jax' not in sys.modules else 1)")
    assert subprocess.run([sys.executable, "-c", code], cwd=ROOT).returncode == 0


def test_gin_builds_the_suite():
    gin.parse_config("""
ReasoningGymSuite.datasets = {
    "chain_sum": {"weight": 3, "config": {"max_terms": 2, "max_digits": 2}},
    "legs": {"dataset": "leg_counting", "config": {"max_animals": 2, "min_animals": 1}},
}
ReasoningGymSuite.num_heldout = 4
ReasoningGymSuite.seed = 7
ReasoningGymSuite.answer_format = "#### {answer}"
""")
    suite = ReasoningGymSuite()
    assert (suite.seed, len(suite.heldout())) == (7, 8)
    p = suite.heldout()[1]
    assert p.meta["dataset"] == "leg_counting" and p.target == f"#### {p.reference}"
    assert suite.grade(p, f"so\n#### {p.reference}").correct
