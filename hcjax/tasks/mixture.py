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

    def category_shares(self) -> tuple[dict[str, str], dict[str, float]]:
        """({category: its member suite's name}, {suite name: its weight}) over `categories()`:
        what a prioritised source needs to give each suite its share (SourceConfig.suite_shares)."""
        groups = {f"{s.name}/{c}": s.name for s, w in zip(self.suites, self.weights, strict=True)
                  if w > 0 for c in s.categories()}
        return groups, {s.name: w for s, w in zip(self.suites, self.weights, strict=True)}

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


@gin.configurable
@dataclasses.dataclass(frozen=True)
class SubsetSuite(SuiteBase):
    """The training problems of `suite` in some of its categories only (e.g. the easy half a
    base is pre-trained on), drawn from that suite's own training stream, so they never include
    its held-out problems. Its held-out split is the parent's, restricted the same way."""

    suite: Any = None
    categories_kept: Sequence[str] = ()
    name: str = "subset"

    def __post_init__(self) -> None:
        check_suite(self.suite, "SubsetSuite.suite")
        kept = tuple(self.categories_kept)
        unknown = sorted(set(kept) - set(self.suite.categories()))
        if not kept or unknown:
            raise ValueError(f"SubsetSuite.categories_kept={list(kept)} must be a non-empty "
                             f"subset of {list(self.suite.categories())}")
        object.__setattr__(self, "categories_kept", kept)
        object.__setattr__(self, "_found", [])  # parent indices of kept problems, in order
        object.__setattr__(self, "_scanned", [0])

    def train_problem(self, index: int) -> TaskProblem:
        if index < 0:
            raise ValueError(f"index={index} must be >= 0")
        found, scanned = self._found, self._scanned
        while len(found) <= index:
            if scanned[0] - (found[-1] if found else 0) > 100_000:
                raise ValueError(f"suite {self.suite.name!r} yields no problem of "
                                 f"{list(self.categories_kept)}")
            if self.suite.train_problem(scanned[0]).category in self.categories_kept:
                found.append(scanned[0])
            scanned[0] += 1
        return self.suite.train_problem(found[index])

    def heldout(self) -> Sequence[TaskProblem]:
        return [p for p in self.suite.heldout() if p.category in self.categories_kept]

    def categories(self) -> Sequence[str]:
        return list(self.categories_kept)

    def grade(self, problem: TaskProblem, response: str) -> Grade:
        return self.suite.grade(problem, response)

    def tools(self, problem: TaskProblem) -> Any:
        return self.suite.tools(problem)

    @property
    def budget(self) -> Any:
        """The parent's ReAct episode budget (None when it has none), so a subset's tool episodes
        run as the parent's do (the climb's sources read `suite.budget`)."""
        return getattr(self.suite, "budget", None)

    def sft_document(self, problem: TaskProblem, tok: Any) -> Any:
        encode = getattr(self.suite, "sft_document", None)
        if encode is None:
            return None
        return encode(problem, tok)
