"""A weighted mixture of task suites as one TaskSuite: problem ids and categories carry the
component suite's name ("code/affine"), so sampling, evaluation and rewards stay per suite."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import gin
import numpy as np

from hcjax.rewards.types import Grade
from hcjax.tasks.base import SuiteBase, TaskProblem, check_suite


@gin.configurable
@dataclasses.dataclass(frozen=True)
class MixtureSuite(SuiteBase):
    """suites: the component suites (distinct names); weights: the share of training problems
    drawn from each (normalised; default equal). Held-out splits are concatenated."""

    suites: Sequence[Any] = ()
    weights: Sequence[float] | None = None
    name: str = "mixture"
    seed: int = 0

    def __post_init__(self) -> None:
        suites = tuple(self.suites)
        if not suites:
            raise ValueError("MixtureSuite.suites is empty; give at least one task suite")
        for i, s in enumerate(suites):
            check_suite(s, f"MixtureSuite.suites[{i}]")
        names = [s.name for s in suites]
        if len(set(names)) != len(names) or any("/" in n for n in names):
            raise ValueError(f"MixtureSuite suite names={names} must be distinct and free of '/'")
        weights = tuple(float(w) for w in (self.weights or [1.0] * len(suites)))
        if len(weights) != len(suites) or any(w < 0 for w in weights) or sum(weights) <= 0:
            raise ValueError(f"MixtureSuite.weights={self.weights} must be {len(suites)} "
                             "non-negative numbers with a positive sum")
        object.__setattr__(self, "suites", suites)
        object.__setattr__(self, "weights", weights)
        object.__setattr__(self, "_by_name", {s.name: s for s in suites})

    # Names ---------------------------------------------------------------------------------
    @staticmethod
    def _wrap(suite: Any, p: TaskProblem) -> TaskProblem:
        return dataclasses.replace(p, id=f"{suite.name}/{p.id}",
                                   category=f"{suite.name}/{p.category}",
                                   meta={**p.meta, "suite": suite.name})

    def owner(self, problem: TaskProblem) -> tuple[Any, TaskProblem]:
        """The component suite of a mixture problem, and the problem as that suite made it."""
        name = problem.meta.get("suite") or problem.id.split("/", 1)[0]
        suite = self._by_name.get(name)
        if suite is None:
            raise ValueError(f"problem {problem.id!r} names suite {name!r}; the mixture has "
                             f"{sorted(self._by_name)}")
        inner = dataclasses.replace(problem, id=problem.id.split("/", 1)[1],
                                    category=problem.category.split("/", 1)[1],
                                    meta={k: v for k, v in problem.meta.items() if k != "suite"})
        return suite, inner

    # TaskSuite ----------------------------------------------------------------------------
    def train_problem(self, index: int) -> TaskProblem:
        if index < 0:
            raise ValueError(f"index={index} must be >= 0")
        p = np.asarray(self.weights) / sum(self.weights)
        j = int(np.random.default_rng([self.seed, index]).choice(len(self.suites), p=p))
        suite = self.suites[j]
        return self._wrap(suite, suite.train_problem(index))

    def heldout(self) -> Sequence[TaskProblem]:
        return [self._wrap(s, p) for s in self.suites for p in s.heldout()]

    def categories(self) -> Sequence[str]:
        return [f"{s.name}/{c}" for s, w in zip(self.suites, self.weights, strict=True) if w > 0
                for c in s.categories()]

    def next_in_category(self, category: str, cursor: int) -> tuple[TaskProblem, int]:
        name, inner = category.split("/", 1) if "/" in category else (category, "")
        suite = self._by_name.get(name)
        if suite is None:
            raise ValueError(f"category {category!r} names no suite of the mixture "
                             f"{sorted(self._by_name)}")
        nxt = getattr(suite, "next_in_category", None) or SuiteBase.next_in_category.__get__(suite)
        p, cursor = nxt(inner, cursor)
        return self._wrap(suite, p), cursor

    def grade(self, problem: TaskProblem, response: str) -> Grade:
        suite, inner = self.owner(problem)
        return suite.grade(inner, response)

    def tools(self, problem: TaskProblem) -> Any:
        suite, inner = self.owner(problem)
        return suite.tools(inner)

    def component(self, problem: TaskProblem) -> Any:
        """The suite a problem belongs to (for per-suite rewards and budgets)."""
        return self.owner(problem)[0]
