"""The task a run is for, one gin config that every job reading a task shares: the climb, shortest
rejection sampling, long2short, consolidation and SFT's evaluation. It names the suite and each
suite's reward shaping; it builds nothing else and knows no job."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import gin

from hcjax.rewards.spec import RewardSpec
from hcjax.tasks.arithmetic import ArithmeticSuite
from hcjax.tasks.base import TaskSuite, check_suite

__all__ = ["TaskConfig", "suite_names"]


def suite_names(suite: Any) -> set[str]:
    """The names a suite answers to: its own and, for a mixture, each component's."""
    return {suite.name, *(s.name for s in getattr(suite, "suites", ()))}


@gin.configurable
@dataclasses.dataclass(frozen=True)
class TaskConfig:
    """suite: the TaskSuite (None: ArithmeticSuite(), the synthetic suite of the tiny default).
    rewards: per suite name, its group reward shaping (hcjax.rewards.spec.RewardSpec); a suite
    with none keeps its grader's rewards."""

    suite: Any = None
    rewards: Mapping[str, Any] = dataclasses.field(default_factory=dict)

    def __post_init__(self) -> None:
        if not isinstance(self.rewards, Mapping) or not all(
                isinstance(spec, RewardSpec) for spec in self.rewards.values()):
            raise ValueError(f"TaskConfig.rewards={self.rewards!r} must map suite names to "
                             "RewardSpecs")

    def make_suite(self) -> TaskSuite:
        """The suite, checked to be a TaskSuite whose names cover every `rewards` key."""
        suite = self.suite if self.suite is not None else ArithmeticSuite()
        check_suite(suite, "TaskConfig.suite")
        unknown = sorted(set(self.rewards) - suite_names(suite))
        if unknown:
            raise ValueError(f"TaskConfig.rewards names suites {unknown}; the task's suites are "
                             f"{sorted(suite_names(suite))}")
        return suite
