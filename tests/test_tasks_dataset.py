"""DatasetSuite: JSONL / Parquet reading, field mapping, the held-out split, the seeded training
stream, strict vs flexible grading for the GSM8K and MATH conventions, and config errors."""

import json
import os
import subprocess
import sys

import gin
import pytest

from hcjax.tasks.base import TaskProblem, TaskSuite, check_suite
from hcjax.tasks.dataset import DatasetSuite, flexible_answer, read_records

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GSM8K_SAMPLE = os.path.join(ROOT, "configs", "data", "gsm8k_sample.jsonl")
MATH_SAMPLE = os.path.join(ROOT, "configs", "data", "math_sample.jsonl")

GSM8K_RECORDS = [
    {"question": f"Ann has {i} apples and buys {i + 3} more. How many apples does she have?",
     "answer": f"She has {i}+{i + 3}=<<{i}+{i + 3}={2 * i + 3}>>{2 * i + 3} apples.\n"
               f"#### {2 * i + 3:,}"}
    for i in range(10, 2010, 200)
]
MATH_RECORDS = [
    {"problem": "Compute $\\frac{1}{4} + \\frac{1}{4}$.",
     "solution": "The sum is $\\boxed{\\frac{1}{2}}$.", "level": "Level 1", "type": "Prealgebra"},
    {"problem": "Solve $2x = 7$.", "solution": "So $x = \\boxed{\\frac{7}{2}}$.",
     "level": "Level 1", "type": "Algebra"},
    {"problem": "What is $\\sqrt{2}\\cdot\\sqrt{8}$?", "solution": "It is $\\boxed{4}$.",
     "level": "Level 2", "type": "Algebra"},
]


def write_jsonl(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(path)


def write_parquet(path, records):
    import pyarrow
    import pyarrow.parquet

    pyarrow.parquet.write_table(pyarrow.Table.from_pylist(records), str(path))
    return str(path)


def essentials(p: TaskProblem):
    return p.id, p.category, p.messages, p.reference, p.target


def problem(reference: str) -> TaskProblem:
    return TaskProblem("p", "c", ({"role": "user", "content": "?"},), reference=reference)


@pytest.fixture
def gsm8k(tmp_path):
    return DatasetSuite(path=write_jsonl(tmp_path / "g.jsonl", GSM8K_RECORDS), num_heldout=3)


@pytest.fixture
def math_suite(tmp_path):
    return DatasetSuite(path=write_jsonl(tmp_path / "m.jsonl", MATH_RECORDS), num_heldout=0,
                        convention="math")


# Reading and field mapping.

def test_jsonl_and_parquet_give_the_same_problems(tmp_path):
    jsonl = DatasetSuite(path=write_jsonl(tmp_path / "g.jsonl", GSM8K_RECORDS), num_heldout=3)
    parquet = DatasetSuite(path=write_parquet(tmp_path / "g.parquet", GSM8K_RECORDS),
                           num_heldout=3)
    assert [essentials(p) for p in jsonl.heldout()] == [essentials(p) for p in parquet.heldout()]
    assert ([essentials(jsonl.train_problem(i)) for i in range(20)]
            == [essentials(parquet.train_problem(i)) for i in range(20)])
    assert parquet.train_problem(0).meta["record"].startswith(f"{tmp_path}/g.parquet row ")
    # an explicit format overrides the extension
    renamed = tmp_path / "g.data"
    renamed.write_bytes((tmp_path / "g.parquet").read_bytes())
    forced = DatasetSuite(path=str(renamed), format="parquet", num_heldout=3)
    assert essentials(forced.train_problem(5)) == essentials(jsonl.train_problem(5))


def test_gsm8k_reference_target_and_prompt(gsm8k):
    by_ref = {p.reference: p for p in [*gsm8k.heldout(), *(gsm8k.train_problem(i)
                                                           for i in range(10))]}
    p = by_ref["1223"]  # "#### 1,223": commas removed
    assert p.target == ("She has 610+613=1223 apples.\n#### 1223")  # calculator notes removed
    assert p.category == "dataset"
    assert p.messages[0]["role"] == "user"
    assert p.prompt.startswith("Ann has 610 apples and buys 613 more.")
    assert p.prompt.endswith('in the form "#### <number>".')
    assert p.id.startswith("q") and len(p.id) == 13  # stable hash of the question


def test_field_mapping_ids_categories_and_system_prompt(tmp_path):
    records = [{"q": "Two plus two?", "sol": 4, "uid": 7, "topic": "add", "src": "x"},
               {"q": "Three times three?", "sol": "9", "uid": "n9"},
               {"q": "Ten minus one?", "sol": "9"}]
    suite = DatasetSuite(path=write_jsonl(tmp_path / "p.jsonl", records), num_heldout=0,
                         convention="plain", name="tiny", system_prompt="Be brief.",
                         prompt_template="Q: {question}",
                         fields={"question": "q", "answer": "sol", "id": "uid",
                                 "category": "topic"})
    got = {p.prompt: p for p in (suite.train_problem(i) for i in range(3))}
    first = got["Q: Two plus two?"]
    assert (first.id, first.category, first.reference, first.target) == ("7", "add", "4",
                                                                         "\\boxed{4}")
    assert first.messages[0] == {"role": "system", "content": "Be brief."}
    assert first.meta["src"] == "x"
    assert got["Q: Three times three?"].id == "n9"
    assert got["Q: Three times three?"].category == "tiny"  # no category: the suite's name
    assert tuple(suite.categories()) == ("add", "tiny")


def test_math_convention_fields_and_nested_boxed(math_suite):
    problems = {p.reference: p for p in (math_suite.train_problem(i) for i in range(3))}
    assert set(problems) == {"\\frac{1}{2}", "\\frac{7}{2}", "4"}
    assert problems["4"].category == "Algebra"
    assert problems["4"].meta["level"] == "Level 2"
    assert tuple(math_suite.categories()) == ("Algebra", "Prealgebra")


# The held-out split and the training stream.

def test_heldout_is_disjoint_from_the_training_stream_and_epochs_cover_the_rest(tmp_path):
    records = GSM8K_RECORDS + [GSM8K_RECORDS[0], GSM8K_RECORDS[4]]  # duplicated questions
    suite = DatasetSuite(path=write_jsonl(tmp_path / "g.jsonl", records), num_heldout=4, seed=3)
    held = {p.prompt for p in suite.heldout()}
    assert len(suite.heldout()) == 4
    n = suite.describe()["train"]
    assert n + suite.describe()["dropped_as_heldout"] + 4 == len(records)
    first = sorted(suite.train_problem(i).prompt for i in range(n))
    assert not held & set(first)
    for epoch in range(1, 4):
        prompts = [suite.train_problem(epoch * n + i).prompt for i in range(n)]
        assert not held & set(prompts)
        assert sorted(prompts) == first  # each epoch yields every training record once
    assert len({suite.train_problem(i).prompt for i in range(n)} | held) == len(GSM8K_RECORDS)


def test_heldout_file_takes_its_first_records_and_is_removed_from_training(tmp_path):
    train = write_jsonl(tmp_path / "train.jsonl", GSM8K_RECORDS)
    test = write_jsonl(tmp_path / "test.jsonl", GSM8K_RECORDS[7:] + GSM8K_RECORDS[:2])
    suite = DatasetSuite(path=train, heldout_path=test, num_heldout=2)
    assert [p.reference for p in suite.heldout()] == ["2823", "3223"]
    assert suite.describe()["train"] == len(GSM8K_RECORDS) - 2
    stream = {suite.train_problem(i).reference for i in range(30)}
    assert not stream & {"2823", "3223"}
    everything = DatasetSuite(path=train, heldout_path=test, num_heldout=None)
    assert len(everything.heldout()) == 5
    assert everything.describe()["dropped_as_heldout"] == 5


def test_training_stream_is_deterministic_and_seeded(tmp_path):
    path = write_jsonl(tmp_path / "g.jsonl", GSM8K_RECORDS)
    a, b = DatasetSuite(path=path, num_heldout=2), DatasetSuite(path=path, num_heldout=2)
    other = DatasetSuite(path=path, num_heldout=2, seed=1)
    stream = [a.train_problem(i).id for i in range(24)]
    assert stream == [b.train_problem(i).id for i in range(24)]
    assert [p.id for p in a.heldout()] == [p.id for p in b.heldout()]
    assert stream != [other.train_problem(i).id for i in range(24)]
    assert stream[:8] != stream[8:16]  # each epoch is shuffled anew
    assert sorted(stream[:8]) == sorted(stream[8:16])
    assert a.train_problem(1000).id == b.train_problem(1000).id  # random access, any order
    with pytest.raises(ValueError, match="index=-1"):
        a.train_problem(-1)


def test_next_in_category_and_protocol(math_suite):
    assert isinstance(math_suite, TaskSuite)
    check_suite(math_suite)
    assert math_suite.tools(math_suite.train_problem(0)) is None
    cursor = 0
    for _ in range(5):
        p, nxt = math_suite.next_in_category("Prealgebra", cursor)
        assert p.category == "Prealgebra" and nxt > cursor
        assert math_suite.train_problem(nxt - 1) == p
        cursor = nxt
    with pytest.raises(ValueError, match="'Geometry'"):
        math_suite.next_in_category("Geometry", 0)


# Grading.

@pytest.mark.parametrize("response, strict, flexible", [
    ("6 + 6 = 12, and 12 * 3.5 = 42.\n#### 42", 1.0, 1.0),
    ("So she has 42 apples.\n#### 42.0", 1.0, 1.0),
    ("The answer is 42.", 0.0, 1.0),
    ("<answer>42</answer>", 0.0, 1.0),
    ("The answer is \\boxed{42}.", 0.0, 1.0),
    ("<think>maybe 41</think>It is 42", 0.0, 1.0),
    ("<think>it is 42", 0.0, 0.0),  # reasoning never finished
    ("#### 41", 0.0, 0.0),
    ("#### 42\nactually, #### 43", 0.0, 0.0),  # the last one counts
    ("no idea", 0.0, 0.0),
])
def test_gsm8k_strict_and_flexible(gsm8k, response, strict, flexible):
    for extraction in ("strict", "flexible"):
        suite = DatasetSuite(path=gsm8k.path, num_heldout=3, extraction=extraction)
        g = suite.grade(problem("42"), response)
        assert g.components == {"strict": strict, "flexible": flexible}
        assert g.reward == g.components[extraction]
        assert g.correct is bool(g.reward)
        assert not g.aborted


def test_gsm8k_commas_and_reasons(gsm8k):
    g = gsm8k.grade(problem("1234"), "The total is 1,234 dollars.\n#### 1,234")
    assert g.components == {"strict": 1.0, "flexible": 1.0}
    g = gsm8k.grade(problem("42"), "I think the answer is 42")
    assert g.reason == ("flexible: last number gave '42', equal to '42'; "
                        "strict: no '#### <number>'")
    g = gsm8k.grade(problem("6.6"), "#### 6.60")
    assert g.correct


@pytest.mark.parametrize("response, reference, strict, flexible", [
    ("Hence \\boxed{\\frac{1}{2}}.", "0.5", 1.0, 1.0),
    ("Hence $\\boxed{0.5}$", "\\frac{1}{2}", 1.0, 1.0),
    ("So $x = \\boxed{3.5}$", "\\frac{7}{2}", 1.0, 1.0),
    ("\\boxed{2} first, then finally \\boxed{\\frac{7}{2}}", "\\frac{7}{2}", 1.0, 1.0),
    ("The answer is 1/2.", "\\frac{1}{2}", 0.0, 1.0),
    ("<answer>\\frac{1}{2}</answer>", "\\frac{1}{2}", 0.0, 1.0),
    ("\\boxed{\\frac{1}{3}}", "0.5", 0.0, 0.0),
    ("\\boxed{4\\sqrt{3}}", "\\sqrt{48}", 1.0, 1.0),
])
def test_math_strict_and_flexible(math_suite, response, reference, strict, flexible):
    g = math_suite.grade(problem(reference), response)
    assert g.components == {"strict": strict, "flexible": flexible}, g.reason
    assert g.reward == flexible and g.correct is bool(flexible)


def test_grading_stops_at_the_time_limit(math_suite):
    suite = DatasetSuite(path=math_suite.path, num_heldout=0, convention="math",
                         grade_timeout_s=0.5)
    g = suite.grade(problem("10^{10^{10^{10}}}"), "\\boxed{9^{9^{9^{9}}}}")
    assert g.components == {"strict": 0.0, "flexible": 0.0}
    assert "exceeded 0.5 s" in g.reason


def test_flexible_answer_order():
    assert flexible_answer("<answer>7</answer> \\boxed{8} #### 9 10") == ("7", "<answer>")
    assert flexible_answer("\\boxed{\\frac{1}{2}} #### 9 10") == ("\\frac{1}{2}", "\\boxed{}")
    assert flexible_answer("#### 1,000 and 10") == ("1000", "####")
    assert flexible_answer("it costs 1,080 dollars, or 7") == ("7", "last number")
    assert flexible_answer("nothing") == (None, "last number")


# Errors.

def test_bad_line_names_file_and_line(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps(GSM8K_RECORDS[0]) + "\n{not json\n")
    with pytest.raises(ValueError, match=f"{path}:2"):
        DatasetSuite(path=str(path), num_heldout=0).train_problem(0)


def test_missing_field_names_field_file_and_record(tmp_path):
    records = [GSM8K_RECORDS[0], {"question": "What?"}]
    path = write_jsonl(tmp_path / "g.jsonl", records)
    with pytest.raises(ValueError, match=f"{path}:2: field 'answer'"):
        DatasetSuite(path=path, num_heldout=0).heldout()
    parquet = write_parquet(tmp_path / "m.parquet", [{"problem": "1+1?", "solution": "2"}])
    with pytest.raises(ValueError, match="m.parquet row 0: field 'solution' has no final answer"):
        DatasetSuite(path=parquet, num_heldout=0, convention="math").heldout()
    with pytest.raises(ValueError, match="field 'answer' has no final answer"):
        DatasetSuite(path=write_jsonl(tmp_path / "h.jsonl", [{"question": "a", "answer": "b"}]),
                     num_heldout=0).heldout()


def test_empty_file_and_too_many_heldout(tmp_path):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    with pytest.raises(ValueError, match="empty dataset"):
        DatasetSuite(path=str(empty), num_heldout=0).heldout()
    with pytest.raises(ValueError, match="num_heldout=10 leaves no training records"):
        DatasetSuite(path=write_jsonl(tmp_path / "g.jsonl", GSM8K_RECORDS),
                     num_heldout=10).heldout()


@pytest.mark.parametrize("kwargs, match", [
    ({"convention": "mmlu"}, "convention='mmlu'"),
    ({"extraction": "loose"}, "extraction='loose'"),
    ({"format": "csv"}, "format='csv'"),
    ({"fields": {"prompt": "q"}}, r"unknown names \['prompt'\]"),
    ({"prompt_template": "Solve it."}, "no {question} placeholder"),
    ({"prompt_template": "{question} {level}"}, "does not format"),
    ({"num_heldout": -1}, "num_heldout=-1"),
    ({"num_heldout": None}, "needs a heldout_path"),
    ({"grade_timeout_s": 0}, "grade_timeout_s=0"),
])
def test_bad_config_values_are_named(tmp_path, kwargs, match):
    path = write_jsonl(tmp_path / "g.jsonl", GSM8K_RECORDS)
    with pytest.raises(ValueError, match=match):
        DatasetSuite(path=path, **kwargs)


def test_bad_paths_are_named(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope.jsonl"):
        DatasetSuite(path=str(tmp_path / "nope.jsonl"))
    with pytest.raises(ValueError, match="path=None"):
        DatasetSuite()
    odd = tmp_path / "data.txt"
    odd.write_text("{}\n")
    with pytest.raises(ValueError, match="extension '.txt'"):
        DatasetSuite(path=str(odd))
    with pytest.raises(ValueError, match="could not be read as Parquet"):
        read_records(str(odd), "parquet")


def test_gin_binds_the_suite(tmp_path):
    path = write_jsonl(tmp_path / "m.jsonl", MATH_RECORDS)
    gin.parse_config([f"DatasetSuite.path = '{path}'", "DatasetSuite.convention = 'math'",
                      "DatasetSuite.num_heldout = 1"])
    suite = DatasetSuite()
    assert (suite.path, suite.convention, len(suite.heldout())) == (path, "math", 1)


# The sample files in configs/data.

@pytest.mark.parametrize("path, convention, size", [(GSM8K_SAMPLE, "gsm8k", 40),
                                                    (MATH_SAMPLE, "math", 22)])
def test_sample_files_load_and_their_targets_grade_correct(path, convention, size):
    suite = DatasetSuite(path=path, convention=convention, num_heldout=5)
    info = suite.describe()
    assert (info["train"], info["heldout"]) == (size - 5, 5)
    problems = [*suite.heldout(), *(suite.train_problem(i) for i in range(size - 5))]
    assert len({p.id for p in problems}) == size
    for p in problems:
        g = suite.grade(p, p.target)
        assert g.components == {"strict": 1.0, "flexible": 1.0}, (p.id, g.reason)
    if convention == "math":
        assert "Number Theory" in suite.categories()


def test_module_does_not_import_jax():
    code = "import sys, hcjax.tasks.dataset; sys.exit('jax' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], cwd=ROOT).returncode == 0
