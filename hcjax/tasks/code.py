"""The synthetic "write a function" suite of the tiny climb: a one-line maths spec such as
"f(x)=3x^2+2x-1" is answered with a fenced Python function, graded by hidden inputs run in the
sandbox (hcjax.rewards.code).  Problems are short enough for a byte-level model with a
256-token context; this module never runs model code outside the sandbox.

Formats (the shortest that `hcjax.rewards.code.extract_program` accepts, a bare ``` fence):

    affine  prompt "f(x)=3x-4"         target "```\\ndef f(x):return 3*x-4\\n```"
    poly2   prompt "f(x)=3x^2+2x-1"    target "```\\ndef f(x):return 3*x**2+2*x-1\\n```"
    mod     prompt "f(x)=3x+4 mod 7"   target "```\\ndef f(x):return (3*x+4)%7\\n```"

The spec's notation differs from Python's (implicit products, `^`, `mod` binding looser than
`+`), so the model must translate rather than copy; any program computing the same function
passes.  Grading packs every hidden input into one call test ("[f(-3),f(0),...]" == "[...]"),
so one sandbox run judges a response.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import gin
import numpy as np

from hcjax.rewards import code as code_reward
from hcjax.rewards.types import Grade
from hcjax.tasks.base import SeededSplits, TaskProblem

KINDS = ("affine", "poly2", "mod")
_SPLIT_CODES = {"train": 0, "heldout": 1}
FENCE = "```"


def _term(coef: int, power: str, first: bool) -> tuple[str, str]:
    """A signed term in spec notation ("3x^2", "-4x") and in Python ("3*x**2", "-4*x")."""
    sign = "-" if coef < 0 else ("" if first else "+")
    mag = abs(coef)
    spec = {"": f"{mag}", "x": f"{mag}x", "x^2": f"{mag}x^2"}[power]
    py = {"": f"{mag}", "x": f"{mag}*x", "x^2": f"{mag}*x**2"}[power]
    return sign + spec, sign + py


def _render(kind: str, coefs: tuple[int, ...]) -> tuple[str, str]:
    """(spec, python expression) of a problem's function."""
    powers = ("x^2", "x", "") if kind == "poly2" else ("x", "")
    terms = [_term(c, p, i == 0) for i, (c, p) in enumerate(zip(coefs, powers))]
    spec, expr = "".join(t[0] for t in terms), "".join(t[1] for t in terms)
    if kind == "mod":
        return f"{spec} mod {coefs[2]}", f"({expr})%{coefs[2]}"
    return spec, expr


def _evaluate(kind: str, coefs: tuple[int, ...], x: int) -> int:
    if kind == "poly2":
        a, b, c = coefs
        return a * x * x + b * x + c
    value = coefs[0] * x + coefs[1]
    return value % coefs[2] if kind == "mod" else value


def reference_program(expr: str) -> str:
    """The target response for a Python expression of x: a bare-fenced one-line `def f(x)`."""
    return f"{FENCE}\ndef f(x):return {expr}\n{FENCE}"


@gin.configurable
@dataclasses.dataclass(frozen=True)
class CodeSuite(SeededSplits):
    """Write `f(x)` from a one-line spec; graded by `num_tests` hidden integer inputs.

    kinds: which function families to draw ("affine": ax+b, "poly2": ax^2+bx+c, "mod":
      (ax+b) mod m), uniformly.
    min_digits / max_digits: the difficulty knob; a problem draws d uniformly from this range and
      its leading coefficient has exactly d digits (2..9 when d=1), the other coefficients are
      non-zero with at most d digits and a random sign, the modulus has d digits (>= 2).
    num_tests: hidden inputs per problem, distinct integers in [-test_range, test_range], fixed
      by the problem (seeded), the same for every response.
    seed / num_heldout: the held-out split is problems 0..num_heldout-1 of the held-out stream;
      the training stream never yields a function (kind, coefficients) of the held-out split.
    heldout_min_digits: the held-out split draws d from [heldout_min_digits, max_digits] only
      (None: from the training range), e.g. to measure the harder half a base solves partly;
      the training stream keeps every d.
    timeout_s / memory_mb: the sandbox limits of one grading run.
    Categories are "<kind>:<d>d", e.g. "poly2:1d" (a mixture shows "code/poly2:1d").
    """

    name: str = "code"
    kinds: Sequence[str] = KINDS
    min_digits: int = 1
    max_digits: int = 1
    num_tests: int = 5
    test_range: int = 20
    seed: int = 0
    num_heldout: int = 100
    heldout_min_digits: int | None = None
    timeout_s: float = 5.0
    memory_mb: int = 256

    def __post_init__(self) -> None:
        bad = [k for k in self.kinds if k not in KINDS]
        if not self.kinds or bad:
            raise ValueError(f"CodeSuite.kinds={tuple(self.kinds)} must be a non-empty subset "
                             f"of {KINDS}")
        object.__setattr__(self, "kinds", tuple(self.kinds))
        if not 1 <= self.min_digits <= self.max_digits <= 6:
            raise ValueError(f"CodeSuite min_digits={self.min_digits}, max_digits="
                             f"{self.max_digits} must satisfy 1 <= min_digits <= max_digits <= 6")
        if self.num_tests < 3:
            raise ValueError(f"CodeSuite.num_tests={self.num_tests} must be >= 3 (a quadratic "
                             "is pinned down by three points)")
        if 2 * self.test_range + 1 < self.num_tests:
            raise ValueError(f"CodeSuite.test_range={self.test_range} gives fewer than "
                             f"num_tests={self.num_tests} distinct inputs")
        if self.num_heldout < 0:
            raise ValueError(f"CodeSuite.num_heldout={self.num_heldout} must be >= 0")
        if self.heldout_min_digits is not None and not (
                self.min_digits <= self.heldout_min_digits <= self.max_digits):
            raise ValueError(f"CodeSuite.heldout_min_digits={self.heldout_min_digits} must be "
                             f"within min_digits={self.min_digits} .. max_digits="
                             f"{self.max_digits}")
        if not self.timeout_s > 0:
            raise ValueError(f"CodeSuite.timeout_s={self.timeout_s} must be positive")

    # Drawing ------------------------------------------------------------------------------
    def _draw(self, rng: np.random.Generator, min_digits: int) -> tuple[str, int, tuple[int, ...]]:
        kind = self.kinds[int(rng.integers(len(self.kinds)))]
        d = int(rng.integers(min_digits, self.max_digits + 1))
        top = 10**d

        def lead() -> int:
            return int(rng.integers(max(2, top // 10), top))

        def other() -> int:
            return int(rng.integers(1, top)) * (1 if rng.integers(2) else -1)

        if kind == "poly2":
            coefs = (lead(), other(), other())
        elif kind == "mod":
            coefs = (lead(), other(), int(rng.integers(max(2, top // 10), top)))
        else:
            coefs = (lead(), other())
        return kind, d, coefs

    def _make(self, kind: str, d: int, coefs: tuple[int, ...], pid: str,
              rng: np.random.Generator) -> TaskProblem:
        spec, expr = _render(kind, coefs)
        span = np.arange(-self.test_range, self.test_range + 1)
        inputs = sorted(int(x) for x in rng.choice(span, self.num_tests, replace=False))
        outputs = [_evaluate(kind, coefs, x) for x in inputs]
        test = code_reward.CallTest("[" + ",".join(f"f({x})" for x in inputs) + "]",
                                    "[" + ",".join(map(str, outputs)) + "]")
        return TaskProblem(
            id=pid, category=f"{kind}:{d}d",
            messages=({"role": "user", "content": f"f(x)={spec}"},),
            reference=test, target=reference_program(expr),
            meta={"kind": kind, "digits": d, "coefficients": coefs, "inputs": tuple(inputs)})

    def _problem(self, split: str, index: int, attempt: int = 0) -> TaskProblem:
        rng = np.random.default_rng([self.seed, _SPLIT_CODES[split], index, attempt])
        low = self.heldout_min_digits if split == "heldout" else None
        kind, d, coefs = self._draw(rng, self.min_digits if low is None else low)
        return self._make(kind, d, coefs, f"{kind}-{split}-{index}", rng)

    # TaskSuite ----------------------------------------------------------------------------
    def _key(self, problem: TaskProblem) -> tuple:
        return (problem.meta["kind"], problem.meta["coefficients"])

    def categories(self) -> Sequence[str]:
        return [f"{k}:{d}d" for k in self.kinds
                for d in range(self.min_digits, self.max_digits + 1)]

    def grade(self, problem: TaskProblem, response: str) -> Grade:
        """1 when the response's last fenced program gives every hidden output; aborted when the
        sandbox itself failed (never a 0 reward for an infrastructure failure)."""
        test = problem.reference
        if not isinstance(test, code_reward.CallTest):
            raise ValueError(f"problem {problem.id!r} reference={test!r} is not a CallTest; "
                             "it was not made by CodeSuite")
        g = code_reward.grade(response, [test], problem_key=problem.id,
                              timeout_s=self.timeout_s, memory_mb=self.memory_mb)
        if g.aborted:
            return g
        return Grade(g.reward, g.reason, correct=bool(g.reward),
                     components={"correct": float(g.reward)})
