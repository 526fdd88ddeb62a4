"""Code grader: run the response's last fenced Python program against stdin/stdout and
function-call tests in the sandbox; the reward is 1 only if every selected test passes (at most
50 per problem, chosen by a seed derived from the problem so every response sees the same
subset; RECIPE §6).  Sandbox infrastructure failures make the grade aborted.  No JAX here."""

from __future__ import annotations

import dataclasses
import hashlib
import random
import re
import secrets
from collections.abc import Sequence

from hcjax import sandbox
from hcjax.rewards.types import Grade

MAX_TESTS = 50
_FENCE = re.compile(r"```[ \t]*(?:python3?|py)?[ \t]*\n(.*?)```", re.DOTALL | re.IGNORECASE)


@dataclasses.dataclass(frozen=True)
class StdioTest:
    """Feed `stdin`; pass when stdout equals `expected` up to trailing whitespace per line."""

    stdin: str
    expected: str


@dataclasses.dataclass(frozen=True)
class CallTest:
    """Evaluate the Python expression `call` after the program; pass when it == `expected`
    (another Python expression, e.g. "add(1, 2)" and "3")."""

    call: str
    expected: str


CodeTest = StdioTest | CallTest


def extract_program(response: str) -> str | None:
    """The last ```python (or bare ```) fenced block of the response, or None."""
    blocks = _FENCE.findall(response)
    return blocks[-1] if blocks else None


def problem_seed(problem_key: str) -> int:
    """A seed fixed by the problem (SHA-256 of its key), the same in every process."""
    return int.from_bytes(hashlib.sha256(problem_key.encode()).digest()[:8], "big")


def select_tests(tests: Sequence[CodeTest], problem_key: str,
                 max_tests: int = MAX_TESTS) -> list[CodeTest]:
    """At most `max_tests` tests, the same subset for every response to the problem."""
    if max_tests <= 0:
        raise ValueError(f"max_tests={max_tests} is not positive")
    if len(tests) <= max_tests:
        return list(tests)
    chosen = random.Random(problem_seed(problem_key)).sample(range(len(tests)), max_tests)
    return [tests[i] for i in sorted(chosen)]


def _normalise_output(text: str) -> list[str]:
    lines = [line.rstrip() for line in text.replace("\r\n", "\n").split("\n")]
    while lines and not lines[-1]:
        lines.pop()
    return lines


# The nonce arrives on stdin, is read before the program runs and lives in a function's local,
# the program runs in its own namespace and harness.py is deleted: a program that exits early
# (os._exit(0)) or prints cannot fake a pass.  When the expected value is plain data, the result
# must be plain data too, so an object whose __eq__ always says True cannot pass.  A program
# that walks the interpreter's frames could still find the nonce; that is beyond this grader.
_CALL_HARNESS = """
import os, sys
def plain(x, depth=0):
    if depth > 50:
        return False
    if type(x) in (int, float, complex, str, bytes, bool, type(None)):
        return True
    if type(x) in (list, tuple, set, frozenset):
        return all(plain(v, depth + 1) for v in x)
    if type(x) is dict:
        return all(plain(k, depth + 1) and plain(v, depth + 1) for k, v in x.items())
    return False
def main():
    nonce = sys.stdin.readline().strip()
    null = os.open("/dev/null", os.O_RDONLY)
    os.dup2(null, 0)  # stdin is a file: the program must not rewind it to read the nonce
    os.unlink("harness.py")
    sys.setrecursionlimit(10000)
    namespace = {{"__name__": "solution"}}  # so `if __name__ == "__main__"` stays off
    try:
        exec(compile(open("solution.py").read(), "solution.py", "exec"), namespace)
    except SystemExit:
        print("the program exited while being loaded", file=sys.stderr)
        os._exit(1)
    got = eval({call!r}, namespace)
    want = eval({expected!r}, namespace)
    if plain(want) and not plain(got):
        print("the result is not plain data", file=sys.stderr)
        os._exit(1)
    if not want == got:
        print("got " + repr(got)[:200], file=sys.stderr)
        os._exit(1)
    sys.stdout.flush()
    os.write(1, ("\\n" + nonce + "\\n").encode())
main()
"""


def _run_test(program: str, test: CodeTest, timeout_s: float, memory_mb: int,
              python: str) -> tuple[bool, sandbox.Outcome]:
    if isinstance(test, StdioTest):
        out = sandbox.run([python, "solution.py"], timeout_s=timeout_s, memory_mb=memory_mb,
                          files={"solution.py": program}, stdin=test.stdin)
        passed = out.ok and _normalise_output(out.stdout) == _normalise_output(test.expected)
        return passed, out
    if isinstance(test, CallTest):
        harness = _CALL_HARNESS.format(call=test.call, expected=test.expected)
        nonce = secrets.token_hex(16)
        out = sandbox.run([python, "harness.py"], timeout_s=timeout_s, memory_mb=memory_mb,
                          files={"solution.py": program, "harness.py": harness},
                          stdin=nonce + "\n")
        return out.ok and out.stdout.endswith("\n" + nonce + "\n"), out
    raise TypeError(f"test={test!r} is not a StdioTest or CallTest")


def grade(response: str, tests: Sequence[CodeTest], *, problem_key: str,
          timeout_s: float = 5.0, memory_mb: int = 512, max_tests: int = MAX_TESTS,
          python: str = "python3") -> Grade:
    """1.0 when the extracted program passes every selected test, else 0.0 (stops at the first
    failure); aborted when the sandbox itself failed."""
    if not tests:
        raise ValueError(f"tests={tests!r} is empty; a code problem needs at least one test")
    program = extract_program(response)
    if program is None:
        return Grade(0.0, "no ```python fenced program in the response")
    selected = select_tests(tests, problem_key, max_tests)
    for i, test in enumerate(selected):
        passed, out = _run_test(program, test, timeout_s, memory_mb, python)
        if out.aborted:
            return Grade(0.0, f"sandbox failure on test {i}: {out.detail}", aborted=True)
        if not passed:
            why = out.status if not out.ok else "wrong answer"
            tail = out.stderr.strip().splitlines()[-1:] if out.stderr.strip() else []
            return Grade(0.0, f"test {i}/{len(selected)} failed: {why}"
                         + (f" ({tail[0][:200]})" if tail else ""))
    return Grade(1.0, f"all {len(selected)} selected tests pass")
