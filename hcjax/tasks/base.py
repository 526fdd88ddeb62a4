"""The task-suite seam of the climb: a `TaskSuite` gives problems (ids, categories, prompts as chat
messages), grades decoded responses with the one `Grade` record, and may give tools for
multi-turn episodes. Suites know nothing about the learner, the engine or JAX.

A suite is any object with the methods of `TaskSuite`; `SuiteBase` supplies the optional ones.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any, Protocol, runtime_checkable

from hcjax.rewards.types import Grade

__all__ = ["SeededSplits", "SuiteBase", "TaskProblem", "TaskSuite", "check_suite",
           "user_prompt"]


@dataclasses.dataclass(frozen=True)
class TaskProblem:
    """One problem of a suite.

    id: unique within the suite (the climb prefixes the suite's name in mixtures).
    category: the sampling category (prioritised samplers draw per category; evaluation reports
      pass@1 per category), e.g. "add:2x1" or "gsm8k".
    messages: the prompt as chat messages ({"role", "content"}), rendered by the tokenizer's chat
      template (ours, or a Hugging Face folder's).
    reference: what the grader compares against (an answer string, unit tests, ...).
    target: a reference assistant response, for SFT of a base on the suite's format (None: the
      suite has no reference solution text).
    meta: anything else worth keeping with the rollouts (shown in the rollout store).
    """

    id: str
    category: str
    messages: tuple[Mapping[str, str], ...]
    reference: Any = None
    target: str | None = None
    meta: Mapping[str, Any] = dataclasses.field(default_factory=dict)

    def __post_init__(self) -> None:
        object.__setattr__(self, "messages", tuple(dict(m) for m in self.messages))
        if not self.messages:
            raise ValueError(f"problem {self.id!r} has no prompt messages")
        for i, m in enumerate(self.messages):
            if m.get("role") not in ("system", "user", "assistant", "tool") or not isinstance(
                    m.get("content"), str):
                raise ValueError(f"problem {self.id!r} message {i}={m!r} needs a role in "
                                 "system/user/assistant/tool and a string content")

    @property
    def prompt(self) -> str:
        """The last user message's text (for logs and the rollout store)."""
        return user_prompt(self.messages)

    def conversation(self) -> list[dict[str, str]]:
        """The prompt messages plus the reference response (SFT documents); needs `target`."""
        if self.target is None:
            raise ValueError(f"problem {self.id!r} has no reference response (target=None)")
        return [*map(dict, self.messages), {"role": "assistant", "content": self.target}]


def user_prompt(messages: Sequence[Mapping[str, str]]) -> str:
    users = [m["content"] for m in messages if m.get("role") == "user"]
    return users[-1] if users else messages[-1]["content"]


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
