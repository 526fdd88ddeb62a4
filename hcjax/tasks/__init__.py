"""Task suites for the climb (the `TaskSuite` seam): synthetic arithmetic, datasets (JSONL or
Parquet, GSM8K / MATH conventions), reasoning-gym's procedural datasets, code with unit tests in
the sandbox, tool use through the ReAct loop, and weighted mixtures. Suites know nothing about
the learner or JAX."""

from hcjax.tasks.arithmetic import ArithmeticSuite
from hcjax.tasks.base import SuiteBase, TaskProblem, TaskSuite, check_suite
from hcjax.tasks.code import CodeSuite
from hcjax.tasks.dataset import DatasetSuite
from hcjax.tasks.mixture import MixtureSuite, SubsetSuite
from hcjax.tasks.reasoning_gym import ReasoningGymSuite
from hcjax.tasks.tool_use import ToolUseSuite

__all__ = ["ArithmeticSuite", "CodeSuite", "DatasetSuite", "MixtureSuite", "ReasoningGymSuite",
           "SuiteBase", "SubsetSuite", "TaskProblem", "TaskSuite", "ToolUseSuite", "check_suite"]
