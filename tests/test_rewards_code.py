"""Code grader: stdin/stdout and call tests in the sandbox, the seeded test subset, reward hacks."""

import os

import pytest

from hcjax import sandbox
from hcjax.rewards import code

needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="the sandbox needs root namespaces")

PROGRAM = """Here is my solution:
```python
def add(a, b):
    return a + b

if __name__ == "__main__":
    a, b = map(int, input().split())
    print(add(a, b))
```
"""
TESTS = [code.StdioTest("1 2\n", "3\n"), code.StdioTest("10 -4", "6"),
         code.CallTest("add(2, 5)", "7"), code.CallTest("add('a', 'b')", "'ab'")]


def test_extract_program_takes_the_last_block():
    response = "```python\nprint(1)\n```\nbetter:\n```py\nprint(2)\n```"
    assert code.extract_program(response) == "print(2)\n"
    assert code.extract_program("no code here") is None


def test_select_tests_is_seeded_by_problem_and_capped():
    tests = [code.CallTest(f"f({i})", str(i)) for i in range(120)]
    first = code.select_tests(tests, "problem-7")
    assert len(first) == code.MAX_TESTS
    assert first == code.select_tests(tests, "problem-7")  # every response: same subset
    assert first != code.select_tests(tests, "problem-8")
    assert [t.call for t in first] == sorted((t.call for t in first), key=lambda c: int(c[2:-1]))
    assert code.select_tests(tests[:5], "p") == tests[:5]
    with pytest.raises(ValueError, match="max_tests=0"):
        code.select_tests(tests, "p", max_tests=0)


@needs_root
def test_correct_program_passes_all_tests():
    grade = code.grade(PROGRAM, TESTS, problem_key="add")
    assert grade.reward == 1.0 and grade.reason == "all 4 selected tests pass"


@needs_root
@pytest.mark.parametrize("response, why, timeout_s", [
    (PROGRAM.replace("a + b", "a - b"), "wrong answer", 20),
    (PROGRAM.replace("return a + b", "raise RuntimeError('x')"), "crash", 20),
    ("```python\nwhile True:\n    pass\n```", "timeout", 1),
    ("```python\nx = bytearray(1 << 31)\n```", "memory", 20),
])
def test_wrong_programs_fail(response, why, timeout_s):
    grade = code.grade(response, TESTS, problem_key="add", timeout_s=timeout_s, memory_mb=256)
    assert grade.reward == 0.0 and not grade.aborted and why in grade.reason


@needs_root
@pytest.mark.parametrize("hack", [
    "import os\nos._exit(0)",                          # exit before the check
    "import sys\nsys.exit(0)",
    "import sys\nprint(sys.stdin.read())\nimport os\nos._exit(0)",  # echo the stdin nonce
    "print(open('harness.py').read())",
    "import os, sys\nos.lseek(0, 0, 0)\nprint(sys.stdin.read())\nsys.stdout.flush()\nos._exit(0)",
    "class Any:\n    def __eq__(self, other):\n        return True\n"
    "    def __ne__(self, other):\n        return False\n"
    "def add(a, b):\n    return Any()",                  # an object equal to everything
    "class Any(int):\n    def __eq__(self, other):\n        return True\n"
    "def add(a, b):\n    return Any(0)",                  # ...even as an int subclass
])
def test_call_tests_resist_reward_hacks(hack):
    response = f"```python\n{hack}\n```"
    assert code.grade(response, [code.CallTest("add(1, 2)", "3")], problem_key="p").reward == 0.0


@needs_root
@pytest.mark.parametrize("expected, result", [("[3]", "[Any()]"), ("{'a': 3}", "{'a': Any()}")])
def test_call_tests_reject_nested_always_equal_objects(expected, result):
    hack = ("class Any:\n    def __eq__(self, other):\n        return True\n"
            f"def add(a, b):\n    return {result}")
    assert code.grade(f"```python\n{hack}\n```", [code.CallTest("add(1, 2)", expected)],
                      problem_key="p").reward == 0.0
    honest = f"```python\ndef add(a, b):\n    return {expected}\n```"
    assert code.grade(honest, [code.CallTest("add(1, 2)", expected)], problem_key="p").reward == 1.0


def test_no_program_and_no_tests():
    assert code.grade("just prose", TESTS, problem_key="p").reward == 0.0
    with pytest.raises(ValueError, match="tests=\\[\\] is empty"):
        code.grade(PROGRAM, [], problem_key="p")


def test_sandbox_failure_is_aborted(monkeypatch):
    def broken(*args, **kwargs):
        return sandbox.Outcome(sandbox.INFRA_ERROR, "", "", None, 0.0, "no namespaces")

    monkeypatch.setattr(sandbox, "run", broken)
    grade = code.grade(PROGRAM, TESTS, problem_key="add")
    assert grade.aborted and grade.reward == 0.0 and "no namespaces" in grade.reason
