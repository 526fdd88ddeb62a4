"""The synthetic arithmetic suite (hcjax.data.tasks.ArithmeticSuite) as a TaskSuite: categories
are operation x operand digits ("add:2x1"), the grader reads the response's answer."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import gin

from hcjax.data.tasks import ArithmeticSuite, Problem, normalize_answer, operands
from hcjax.data.template import hf_answer, parse_answer
from hcjax.rewards.types import Grade
from hcjax.tasks.base import SuiteBase, TaskProblem

EXTRACTIONS = ("strict", "flexible")


def arithmetic_category(problem: Problem) -> str:
    """A problem's sampling category: its kind and its operands' digit counts ("add:2x1")."""
    a, b = operands(problem)
    return f"{problem.kind}:{len(a)}x{len(b)}"


def _task_problem(p: Problem) -> TaskProblem:
    return TaskProblem(id=p.id, category=arithmetic_category(p),
                       messages=({"role": "user", "content": p.prompt},), reference=p.answer,
                       target=p.target(), meta={"kind": p.kind, "difficulty": p.difficulty})


@gin.configurable
@dataclasses.dataclass(frozen=True)
class ArithmeticTasks(SuiteBase):
    """The arithmetic problems of `ArithmeticSuite` (configured on it in gin).

    extraction: which answer counts as the reward. "strict": the last `<answer>…</answer>` block
    (our reasoning template); "flexible": that block, else the last `\\boxed{}`, else the last
    number after the reasoning (`hf_answer`, for chat models that do not write our tags). Both
    are reported in the Grade's components.
    """

    name: str = "arithmetic"
    extraction: str = "strict"
    suite: ArithmeticSuite | None = None

    def __post_init__(self) -> None:
        if self.extraction not in EXTRACTIONS:
            raise ValueError(f"ArithmeticTasks.extraction={self.extraction!r} is not one of "
                             f"{EXTRACTIONS}")
        if self.suite is None:
            object.__setattr__(self, "suite", ArithmeticSuite())

    def train_problem(self, index: int) -> TaskProblem:
        return _task_problem(self.suite.train_problem(index))

    def heldout(self) -> Sequence[TaskProblem]:
        cached = self.__dict__.get("_heldout")
        if cached is None:
            cached = [_task_problem(p) for p in self.suite.heldout()]
            object.__setattr__(self, "_heldout", cached)
        return cached

    def grade(self, problem: TaskProblem, response: str) -> Grade:
        want = normalize_answer(str(problem.reference))
        parts = {}
        for mode, got in (("strict", parse_answer(response)), ("flexible", hf_answer(response))):
            parts[mode] = float(got is not None and normalize_answer(got) == want)
        reward = parts[self.extraction]
        got = parse_answer(response) if self.extraction == "strict" else hf_answer(response)
        reason = (f"no answer ({self.extraction})" if got is None
                  else f"answer {got!r} {'equals' if reward else 'differs from'} {want!r}")
        return Grade(reward, reason, correct=bool(reward), components=parts)
