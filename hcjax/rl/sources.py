"""Where the climb's problems come from: a task suite's problems turned into worker Tasks
(`TaskBuilder`: prompt ids in the tokenizer's chat template, a grader of response ids, tools and
the suite's reward shaping), drawn in index order or by a prioritised rule per category with an
easy-to-hard curriculum (RECIPE §5), configured by `SourceConfig` in gin."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import gin

from hcjax.data.template import messages_prompt_ids
from hcjax.envs.react import Budget, ChatTemplateTurns
from hcjax.rewards.types import Grade
from hcjax.rl.curriculum import PRIORITY_RULES, PrioritizedSampler
from hcjax.rl.workers import GroupResult, Task

__all__ = ["PrioritizedSource", "SequentialSource", "SourceConfig", "TaskBuilder", "longest_prompt",
           "make_source"]

SAMPLERS = ("sequential", "prioritized")


@gin.configurable
@dataclasses.dataclass(frozen=True)
class SourceConfig:
    """How training problems are drawn.

    sampler: "sequential" (index order) or "prioritized" (per category, hcjax.rl.curriculum
      .PrioritizedSampler with `rule`, `window` and `floor`).
    curriculum_fraction / curriculum_steps: Kimi's easy-to-hard curriculum over categories in
      the suite's order: the pool starts with that fraction of the categories and grows to all
      of them over `curriculum_steps` learner steps (1.0: no curriculum).
    suite_shares (prioritized, a MixtureSuite only): each draw first picks a member suite by
      the mixture's weights, then one of its categories by `rule`, so every suite gets its share
      of the groups however its pass rates compare with the others' (False: one draw over all
      categories, where a suite of many learnable categories takes most of the climb).
    """

    sampler: str = "sequential"
    rule: str = "learnability"
    window: int = 64
    floor: float = 0.05
    curriculum_fraction: float = 1.0
    curriculum_steps: int = 1
    suite_shares: bool = False
    seed: int = 0

    def __post_init__(self) -> None:
        if self.sampler not in SAMPLERS:
            raise ValueError(f"SourceConfig.sampler={self.sampler!r} is not one of {SAMPLERS}")
        if self.rule not in PRIORITY_RULES:
            raise ValueError(f"SourceConfig.rule={self.rule!r} is not one of {PRIORITY_RULES}")
        if self.window < 1 or not 0.0 < self.floor <= 1.0:
            raise ValueError(f"SourceConfig.window={self.window} must be >= 1 and floor="
                             f"{self.floor} in (0, 1]")
        if not 0.0 < self.curriculum_fraction <= 1.0 or self.curriculum_steps < 1:
            raise ValueError(f"SourceConfig.curriculum_fraction={self.curriculum_fraction} must "
                             f"be in (0, 1] and curriculum_steps={self.curriculum_steps} >= 1")
        if self.suite_shares and self.sampler != "prioritized":
            raise ValueError(f"SourceConfig.suite_shares=True needs sampler='prioritized' (got "
                             f"sampler={self.sampler!r})")


class TaskBuilder:
    """Turns a suite's problems into worker Tasks for one tokenizer.

    max_prompt_len: the engine's prefill limit; a longer prompt is an error naming the problem.
    max_context: caps a tool episode's context (its budget's max_context): every model turn is
      a prefill of everything before it, which must fit the engine.
    budget: the ReAct episode budget for problems with tools (hcjax.envs.react.Budget).
    shaping(suite) -> the group reward shaping of a problem's suite, or None (hcjax.rewards.spec).
    template_observations: tool episodes take their observations from the tokenizer's chat
      template (tool messages, hcjax.envs.react.ChatTemplateTurns) and count template drift;
      needs a tokenizer with a chat template (an HFTokenizer). False: plain-text observations.
    """

    def __init__(self, suite: Any, tok: Any, *, max_prompt_len: int | None = None,
                 max_context: int | None = None, budget: Any = None,
                 shaping: Callable[[Any], Any] | None = None,
                 template_observations: bool = False) -> None:
        if template_observations and not hasattr(tok, "render_chat_template"):
            raise ValueError(f"template_observations=True needs a tokenizer with a chat template "
                             f"(an HFTokenizer), got {type(tok).__name__}")
        self.template_observations = template_observations
        self.suite, self.tok = suite, tok
        self.max_prompt_len = max_prompt_len
        self.max_context = max_context
        self.budget = budget
        self.shaping = shaping

    def component(self, problem) -> Any:
        """The suite that owns `problem` (a mixture's component, else the suite itself)."""
        component = getattr(self.suite, "component", None)
        return component(problem) if component is not None else self.suite

    def prompt_ids(self, problem) -> tuple[int, ...]:
        ids = tuple(messages_prompt_ids(problem.messages, self.tok))
        if self.max_prompt_len is not None and len(ids) > self.max_prompt_len:
            raise ValueError(
                f"problem {problem.id} ({problem.prompt[:60]!r}) has a {len(ids)}-token prompt; "
                f"the engine's max prefill length is {self.max_prompt_len} (set "
                "ClimbConfig.max_prompt_len)")
        return ids

    def task(self, problem) -> Task:
        suite, tok = self.suite, self.tok

        def grade(ids: Sequence[int]) -> Grade:
            return suite.grade(problem, tok.decode(list(ids)))

        tools = suite.tools(problem)
        owner = self.component(problem)
        budget = getattr(owner, "budget", None) or self.budget
        if tools is not None and self.max_context is not None:
            budget = budget or Budget()
            budget = dataclasses.replace(budget,
                                         max_context=min(budget.max_context, self.max_context))
        return Task(problem.id, self.prompt_ids(problem), grade,
                    {"prompt": problem.prompt, "answer": _jsonable(problem.reference),
                     "category": problem.category},
                    tools=tools, tokenizer=tok if tools is not None else None,
                    budget=budget,
                    chat=(ChatTemplateTurns(tok, problem.messages)
                          if tools is not None and self.template_observations else None),
                    shaping=self.shaping(owner) if self.shaping is not None else None)

    def longest_prompt(self, scan: int = 2000) -> int:
        return longest_prompt(self.suite, self.tok, scan)


def longest_prompt(suite: Any, tok: Any, scan: int = 2000) -> int:
    """Tokens of the longest templated prompt among a suite's held-out problems and its first
    `scan` training problems."""
    problems = [*suite.heldout(), *(suite.train_problem(i) for i in range(scan))]
    return max(len(messages_prompt_ids(p.messages, tok)) for p in problems)


def _jsonable(value: Any) -> Any:
    return value if isinstance(value, (str, int, float, bool, type(None))) else repr(value)


class SequentialSource:
    """Problems in index order from `make(index)`; the state is the next index."""

    def __init__(self, make: Callable[[int], Task], start: int = 0) -> None:
        self.make = make
        self.next_index = start

    def next_task(self) -> Task:
        task = self.make(self.next_index)
        self.next_index += 1
        return task

    def update(self, group: GroupResult) -> None:
        del group  # the order does not depend on results

    def advance(self, step: int) -> None:
        del step

    def state_dict(self) -> dict:
        return {"next_index": self.next_index}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.next_index = int(state["next_index"])


class PrioritizedSource:
    """Problems drawn per *category* by a PrioritizedSampler (task streams where every problem
    is new, so only categories recur): pick a category, then take its next problem
    (`make(category, cursor)` returns (task, next cursor)). `advance(step)` grows the curriculum
    pool (`curriculum_steps` learner steps to reach every category)."""

    def __init__(self, categories: Sequence[str], make: Callable[[str, int], tuple[Task, int]],
                 category_of: Callable[[Task], str], *, window: int = 64, floor: float = 0.05,
                 rule: str = "kimi", seed: int = 0, curriculum_fraction: float = 1.0,
                 curriculum_steps: int = 1, groups: Mapping[str, str] | None = None,
                 shares: Mapping[str, float] | None = None) -> None:
        if not categories:
            raise ValueError("PrioritizedSource needs at least one category")
        if not 0.0 < floor <= 1.0:
            raise ValueError(f"floor={floor} must be in (0, 1]")
        self.sampler = PrioritizedSampler(list(categories), rule=rule, window=window, floor=floor,
                                          initial_fraction=curriculum_fraction, seed=seed,
                                          groups=groups, shares=shares)
        self.categories = list(categories)
        self.make, self.category_of = make, category_of
        self.curriculum_steps = curriculum_steps
        self.progress = 0.0 if curriculum_fraction < 1.0 else 1.0
        self.cursors = {c: 0 for c in self.categories}

    def success_rate(self, category: str) -> float:
        return self.sampler.success_rate(category)

    def probabilities(self) -> dict[str, float]:
        return self.sampler.probabilities(self.progress)

    def advance(self, step: int) -> None:
        """The learner's step: the curriculum pool grows with it."""
        self.progress = min(1.0, step / self.curriculum_steps)

    def next_task(self) -> Task:
        category = self.sampler.sample(1, self.progress)[0]
        task, self.cursors[category] = self.make(category, self.cursors[category])
        return task

    def update(self, group: GroupResult) -> None:
        category = self.category_of(group.task)
        if category not in self.cursors:
            raise ValueError(f"group {group.task.id!r} has unknown category {category!r}")
        self.sampler.observe(category, group.pass_rate, 1)

    def state_dict(self) -> dict:
        return {"cursors": dict(self.cursors), "sampler": self.sampler.state_dict(),
                "progress": self.progress}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        if set(state["cursors"]) != set(self.categories):
            raise ValueError(f"checkpointed categories {sorted(state['cursors'])} differ from "
                             f"this run's {sorted(self.categories)}")
        self.cursors = {c: int(v) for c, v in state["cursors"].items()}
        self.sampler.load_state_dict(state["sampler"])
        self.progress = float(state.get("progress", self.progress))


def make_source(builder: TaskBuilder, cfg: SourceConfig):
    """The climb's problem source over `builder.suite`."""
    suite = builder.suite
    if cfg.sampler == "sequential":
        return SequentialSource(lambda i: builder.task(suite.train_problem(i)))

    def make(category: str, cursor: int) -> tuple[Task, int]:
        problem, cursor = suite.next_in_category(category, cursor)
        return builder.task(problem), cursor

    groups = shares = None
    if cfg.suite_shares:
        category_shares = getattr(suite, "category_shares", None)
        if category_shares is None:
            raise ValueError(f"SourceConfig.suite_shares=True needs a mixture of suites "
                             f"(MixtureSuite); the climb's suite {getattr(suite, 'name', suite)!r}"
                             " has no member suites to share between")
        groups, shares = category_shares()
    return PrioritizedSource(list(suite.categories()), make, lambda t: t.meta["category"],
                             window=cfg.window, floor=cfg.floor, rule=cfg.rule, seed=cfg.seed,
                             curriculum_fraction=cfg.curriculum_fraction,
                             curriculum_steps=cfg.curriculum_steps, groups=groups, shares=shares)
