"""The synthetic arithmetic suite of the tiny default ("482+57=", answers checkable exactly): one
TaskSuite that the climb rolls out, the SFT pipeline trains a base on (its problems' reference
responses) and evaluation grades. Categories are operation x operand digits ("add:2x1")."""

from __future__ import annotations

import dataclasses
import zlib
from collections.abc import Sequence

import gin
import numpy as np

from hcjax.data.template import hf_answer, normalize_answer, parse_answer, reasoning_response
from hcjax.rewards.types import Grade
from hcjax.tasks.base import SeededSplits, TaskProblem

KINDS = ("add", "sub", "mul", "mod")
THOUGHTS = ("reversed", "none", "steps", "recheck")
EXTRACTIONS = ("strict", "flexible")
_SPLIT_CODES = {"train": 0, "heldout": 1}
_OPS = {"add": "+", "sub": "-", "mul": "*", "mod": "%"}


@gin.configurable
@dataclasses.dataclass(frozen=True)
class ArithmeticSuite(SeededSplits):
    """Integer arithmetic problems like "482+57=", answers checkable exactly.

    name: the suite's name in mixtures and metrics.
    extraction: which answer counts as the reward. "strict": the last `<answer>…</answer>` block
      (our reasoning template); "flexible": that block, else the last `\\boxed{}`, else the last
      number after the reasoning (`hf_answer`, for chat models that do not write our tags). Both
      are reported in the Grade's components.
    difficulty knob: operand length is drawn uniformly from [min_digits, max_digits] digits.
    thought: the reasoning inside <think> of each problem's reference response (`target`, what a
      base is trained on). "reversed" writes the answer's digits least-significant first, a
      scratchpad that lets small models carry left to right; "none" leaves <think> empty;
      "steps" writes the column-by-column working before those reversed digits (`steps_thought`:
      "47+85=" thinks "7+5+0=12 4+8+1=13 231"), a long chain of thought for long2short;
      "recheck" writes that working, then " check " and the same working again: an overthinking
      chain whose second half is redundant (`recheck_thought`).
    short_fraction (with "steps" or "recheck" only): that share of problems, fixed per problem
      id, gets the next shorter thought instead ("steps": "reversed"; "recheck": "steps"), so a
      model pre-trained on the mix samples both lengths.
    The held-out split is problems 0..num_heldout-1 of the held-out stream (fixed by `seed`);
    the training stream never yields a problem that is in the held-out set.
    heldout_min_digits draws the held-out split only from problems whose first operand has at
    least that many digits (None: from the training distribution). Single-digit problems form a
    fact table of ~150 entries: holding some out removes those facts from training altogether, so
    held-out accuracy on them measures facts the model was never shown, not arithmetic.
    Problems carry meta {"kind", "difficulty"} (difficulty: the first operand's digit count).
    """

    name: str = "arithmetic"
    extraction: str = "strict"
    kinds: Sequence[str] = ("add", "sub", "mul")
    min_digits: int = 1
    max_digits: int = 3
    seed: int = 0
    num_heldout: int = 200
    thought: str = "reversed"
    heldout_min_digits: int | None = None
    short_fraction: float = 0.0

    def __post_init__(self) -> None:
        if self.extraction not in EXTRACTIONS:
            raise ValueError(f"ArithmeticSuite.extraction={self.extraction!r} is not one of "
                             f"{EXTRACTIONS}")
        bad = [k for k in self.kinds if k not in KINDS]
        if not self.kinds or bad:
            raise ValueError(f"kinds={tuple(self.kinds)} must be a non-empty subset of {KINDS}")
        if not 1 <= self.min_digits <= self.max_digits <= 18:
            raise ValueError(
                f"min_digits={self.min_digits}, max_digits={self.max_digits} must satisfy "
                "1 <= min_digits <= max_digits <= 18"
            )
        if self.thought not in THOUGHTS:
            raise ValueError(f"thought={self.thought!r} is not one of {THOUGHTS}")
        if not 0.0 <= self.short_fraction <= 1.0 or (
                self.short_fraction and self.thought not in ("steps", "recheck")):
            raise ValueError(f"short_fraction={self.short_fraction} must be in [0, 1], and 0 "
                             f"unless thought is 'steps' or 'recheck' (thought={self.thought!r})")
        if self.heldout_min_digits is not None and not (
                self.min_digits <= self.heldout_min_digits <= self.max_digits):
            raise ValueError(
                f"heldout_min_digits={self.heldout_min_digits} must be within min_digits="
                f"{self.min_digits} .. max_digits={self.max_digits}")
        if self.num_heldout < 0:
            raise ValueError(f"num_heldout={self.num_heldout} must be >= 0")
        object.__setattr__(self, "kinds", tuple(self.kinds))

    # Drawing ------------------------------------------------------------------------------
    def _draw(self, rng: np.random.Generator) -> tuple[str, int, int, int]:
        kind = self.kinds[int(rng.integers(len(self.kinds)))]
        d = int(rng.integers(self.min_digits, self.max_digits + 1))

        def number(digits: int) -> int:
            lo = 0 if digits == 1 else 10 ** (digits - 1)
            return int(rng.integers(lo, 10**digits))

        a = number(d)
        if kind == "mul":
            b = number(1)  # d-digit times one digit: hard enough for a tiny model
        elif kind == "mod":
            b = int(rng.integers(2, 10 if d < 3 else 100))
        else:
            b = number(int(rng.integers(1, d + 1)))
            if kind == "sub" and b > a:
                a, b = b, a
        return kind, a, b, d

    def _make(self, kind: str, a: int, b: int, d: int, pid: str) -> TaskProblem:
        answer = str(_value(kind, a, b))
        thought = answer[::-1] if self.thought == "reversed" else ""
        if self.thought in ("steps", "recheck"):
            # crc32 of the id: a fixed per-problem draw that leaves the operand streams alone.
            short = zlib.crc32(pid.encode()) / 2**32 < self.short_fraction
            if self.thought == "steps":
                thought = answer[::-1] if short else steps_thought(kind, a, b)
            else:
                thought = (steps_thought if short else recheck_thought)(kind, a, b)
        prompt = f"{a}{_OPS[kind]}{b}="
        return TaskProblem(id=pid, category=f"{kind}:{len(str(a))}x{len(str(b))}",
                           messages=({"role": "user", "content": prompt},), reference=answer,
                           target=reasoning_response(thought, answer),
                           meta={"kind": kind, "difficulty": d})

    def _problem(self, split: str, index: int, attempt: int = 0) -> TaskProblem:
        # The held-out stream seeds by index alone; the training stream by (index, attempt), so
        # a training draw that collides with the held-out split is redrawn (SeededSplits).
        if split == "heldout":
            rng = np.random.default_rng([self.seed, _SPLIT_CODES[split], index])
            kind, a, b, d = self._draw(rng)
            while self.heldout_min_digits is not None and d < self.heldout_min_digits:
                kind, a, b, d = self._draw(rng)  # same stream: deterministic per index
        else:
            rng = np.random.default_rng([self.seed, _SPLIT_CODES[split], index, attempt])
            kind, a, b, d = self._draw(rng)
        return self._make(kind, a, b, d, f"{kind}-{split}-{index}")

    def _key(self, problem: TaskProblem) -> tuple[str, int, int]:
        a, b = operands(problem)
        return problem.meta["kind"], int(a), int(b)

    # TaskSuite ----------------------------------------------------------------------------
    def grade(self, problem: TaskProblem, response: str) -> Grade:
        """1 when the answer that `extraction` reads equals the reference (integers by value)."""
        want = normalize_answer(str(problem.reference))
        parts = {}
        for mode, got in (("strict", parse_answer(response)), ("flexible", hf_answer(response))):
            parts[mode] = float(got is not None and normalize_answer(got) == want)
        reward = parts[self.extraction]
        got = parse_answer(response) if self.extraction == "strict" else hf_answer(response)
        reason = (f"no answer ({self.extraction})" if got is None
                  else f"answer {got!r} {'equals' if reward else 'differs from'} {want!r}")
        return Grade(reward, reason, correct=bool(reward), components=parts)


def _value(kind: str, a: int, b: int) -> int:
    return {"add": a + b, "sub": a - b, "mul": a * b, "mod": a % b if b else 0}[kind]


def steps_thought(kind: str, a: int, b: int) -> str:
    """Column-by-column working of `a op b`, then the answer's digits least-significant first.

    add / sub / mul: one "x op y op c=v" per column of `a`, least significant first, where c is
    the carry (add, mul) or borrow (sub) coming in and v the column's value ("7+5+0=12": digit 2,
    carry 1; "3-8-0=-5": digit 5, borrow 1); a last carry is the answer's top digit. mod:
    "a=q*b+r". Space-separated: "47+85=" -> "7+5+0=12 4+8+1=13 231"."""
    value = _value(kind, a, b)
    if kind == "mod":
        return f"{a}={a // b if b else 0}*{b}+{value} {str(value)[::-1]}"
    op = _OPS[kind]
    ys = [int(ch) for ch in reversed(str(b))]
    steps, c = [], 0
    for i, x in enumerate(int(ch) for ch in reversed(str(a))):
        y = b if kind == "mul" else (ys[i] if i < len(ys) else 0)
        v = {"add": x + y + c, "sub": x - y - c, "mul": x * y + c}[kind]
        steps.append(f"{x}{op}{y}{'-' if kind == 'sub' else '+'}{c}={v}")
        c = int(v < 0) if kind == "sub" else v // 10
    return " ".join([*steps, str(value)[::-1]])


def recheck_thought(kind: str, a: int, b: int) -> str:
    """`steps_thought`, then " check " and the same working once more: a chain of thought whose
    second half adds nothing ("47+85=" -> "7+5+0=12 4+8+1=13 231 check 7+5+0=12 4+8+1=13 231").
    The answer needs only the first half, so a model can drop the second without losing accuracy:
    the overthinking that long2short removes."""
    steps = steps_thought(kind, a, b)
    return f"{steps} check {steps}"


def operands(problem: TaskProblem) -> tuple[str, str]:
    """The two operand strings of an arithmetic problem's prompt ("56-3=" -> ("56", "3"))."""
    for op in "+-*%":
        if op in problem.prompt:
            a, b = problem.prompt.rstrip("=").split(op)
            return a, b
    raise ValueError(f"prompt={problem.prompt!r} is not an arithmetic problem")
