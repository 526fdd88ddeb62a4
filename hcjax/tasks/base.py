"""The task-suite seam of the climb: a `TaskSuite` gives problems (ids, categories, prompts as chat
messages), grades decoded responses with the one `Grade` record, and may give tools for
multi-turn episodes. Suites know nothing about the learner, the engine or JAX.

A suite is any object with the methods of `TaskSuite`; `SuiteBase` supplies the optional ones.
Its problems are `TaskProblem`s (hcjax.data.problem, re-exported here: the one problem record).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol, runtime_checkable

from hcjax.data.problem import TaskProblem, user_prompt
from hcjax.rewards.types import Grade

__all__ = ["SeededSplits", "SuiteBase", "TaskProblem", "TaskSuite", "check_suite",
           "user_prompt"]


@runtime_checkable
class TaskSuite(Protocol):
    """What the climb needs from a task suite.

    name: short identifier (used in mixtures, metrics and problem ids).
    train_problem(index): training problem `index`, deterministic; never a held-out problem.
    heldout(): the fixed held-out split, evaluated greedily through the inference client.
    categories(): the categories the training stream draws from.
    grade(problem, response): the decoded response's Grade (reward, correct, components).
    tools(problem): a tool runner (hcjax.envs.react.ToolRunner) for a multi-turn episode, or
      None for single-turn problems.
    """

    name: str

    def train_problem(self, index: int) -> TaskProblem: ...

    def heldout(self) -> Sequence[TaskProblem]: ...

    def categories(self) -> Sequence[str]: ...

    def grade(self, problem: TaskProblem, response: str) -> Grade: ...

    def tools(self, problem: TaskProblem) -> Any: ...


class SuiteBase:
    """Defaults for the optional parts of a suite: no tools, categories found by scanning the
    first `category_scan` training problems, and `next_in_category` by scanning forward."""

    name: str = "suite"
    category_scan: int = 2000

    def tools(self, problem: TaskProblem) -> Any:
        del problem
        return None

    def categories(self) -> Sequence[str]:
        return sorted({self.train_problem(i).category for i in range(self.category_scan)})

    def next_in_category(self, category: str, cursor: int) -> tuple[TaskProblem, int]:
        """The first training problem of `category` at index >= cursor, and the next cursor."""
        for i in range(cursor, cursor + 100_000):
            p = self.train_problem(i)
            if p.category == category:
                return p, i + 1
        raise ValueError(f"suite {self.name!r} has no training problem of category "
                         f"{category!r} after index {cursor}")

    def train_problem(self, index: int) -> TaskProblem:  # pragma: no cover - abstract
        raise NotImplementedError


class SeededSplits(SuiteBase):
    """Synthetic suites with a fixed held-out split: problem `index` of a split is drawn from
    a generator seeded by (split, index, attempt) in `_problem`; the training stream redraws
    (attempt + 1) any problem whose `_key` is held out. Subclasses set `num_heldout`."""

    num_heldout: int = 0

    def _problem(self, split: str, index: int, attempt: int = 0) -> TaskProblem:
        raise NotImplementedError  # pragma: no cover - abstract

    def _key(self, problem: TaskProblem) -> Any:
        raise NotImplementedError  # pragma: no cover - abstract

    def heldout(self) -> Sequence[TaskProblem]:
        cached = self.__dict__.get("_heldout")
        if cached is None:
            cached = [self._problem("heldout", i) for i in range(self.num_heldout)]
            object.__setattr__(self, "_heldout", cached)
            object.__setattr__(self, "_heldout_keys", frozenset(map(self._key, cached)))
        return cached

    def train_problem(self, index: int) -> TaskProblem:
        if index < 0:
            raise ValueError(f"index={index} must be >= 0")
        self.heldout()
        held = self.__dict__["_heldout_keys"]
        for attempt in range(1000):
            p = self._problem("train", index, attempt)
            if self._key(p) not in held:
                return p
        raise ValueError(f"{type(self).__name__}: could not draw a training problem outside the "
                         f"held-out set for index={index}; the configuration leaves too few "
                         "distinct problems")


def check_suite(suite: Any, what: str = "suite") -> None:
    """Raise a TypeError naming the missing methods when `suite` is not a TaskSuite."""
    missing = [m for m in ("name", "train_problem", "heldout", "categories", "grade", "tools")
               if not hasattr(suite, m)]
    if missing:
        raise TypeError(f"{what}={suite!r} is not a TaskSuite: it lacks {missing} "
                        "(see hcjax.tasks.base.TaskSuite)")
