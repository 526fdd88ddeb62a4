"""The ReAct loop over token ids (RECIPE §3, agentic climb): the policy's tokens and the encoded
tool observations are appended to one growing sequence that is never re-tokenised, with a loss
mask of 1 on policy tokens and 0 on observations; budgets on steps, context and time.  No JAX."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence
from typing import Protocol

from hcjax.envs.tools import MalformedCall, ToolResult, parse_tool_calls

STOP = "stop"  # the model answered without a tool call
MAX_STEPS = "max_steps"
CONTEXT = "context"
TIME = "time"
ABORTED = "aborted"  # a tool's infrastructure failed: the rollout is dropped, never scored 0


class TokenizerLike(Protocol):
    def encode(self, text: str) -> list[int]: ...
    def decode(self, ids: Sequence[int]) -> str: ...


class Policy(Protocol):
    """Returns the new tokens of one model turn given the whole sequence so far."""

    def __call__(self, token_ids: Sequence[int]) -> list[int]: ...


class ToolRunner(Protocol):
    def __call__(self, call) -> ToolResult: ...


@dataclasses.dataclass(frozen=True)
class Budget:
    max_steps: int = 16  # model turns that call tools
    max_context: int = 32768  # prompt + response tokens
    max_time_s: float = 600.0

    def __post_init__(self) -> None:
        if self.max_steps <= 0 or self.max_context <= 0 or self.max_time_s <= 0:
            raise ValueError(f"budget={self!r} must be positive in every field")


def default_observation(results: Sequence[ToolResult]) -> str:
    body = "\n".join(r.output for r in results)
    return f"\n<tool_result>\n{body}\n</tool_result>\n"


@dataclasses.dataclass
class Trajectory:
    """prompt_ids + response_ids is the exact sequence the policy saw; loss_mask[i] is 1 where
    response_ids[i] came from the policy."""

    prompt_ids: list[int]
    response_ids: list[int] = dataclasses.field(default_factory=list)
    loss_mask: list[int] = dataclasses.field(default_factory=list)
    finish_reason: str = ""
    num_tool_calls: int = 0
    num_malformed: int = 0
    num_successful: int = 0
    final_text: str = ""  # the last policy turn, decoded (where a final answer lives)
    turns: list[str] = dataclasses.field(default_factory=list)

    @property
    def aborted(self) -> bool:
        return self.finish_reason == ABORTED

    def _append(self, ids: Sequence[int], from_policy: bool) -> None:
        self.response_ids.extend(ids)
        self.loss_mask.extend([1 if from_policy else 0] * len(ids))


def run_episode(prompt_ids: Sequence[int], policy: Policy, tokenizer: TokenizerLike,
                tools: ToolRunner, budget: Budget = Budget(), *,
                observation: Callable[[Sequence[ToolResult]], str] = default_observation,
                clock: Callable[[], float] = time.monotonic) -> Trajectory:
    """Alternate policy turns and tool observations until the model stops calling tools or a
    budget runs out; the trajectory is graded afterwards by the environment."""
    traj = Trajectory(prompt_ids=list(prompt_ids))
    if len(traj.prompt_ids) >= budget.max_context:
        traj.finish_reason = CONTEXT
        return traj
    deadline = clock() + budget.max_time_s
    steps = 0
    while True:
        room = budget.max_context - len(traj.prompt_ids) - len(traj.response_ids)
        if room <= 0:  # the observations filled the context: no room for another turn
            traj.finish_reason = CONTEXT
            return traj
        new = list(policy(traj.prompt_ids + traj.response_ids))
        cut = len(new) > room
        new = new[:room]
        traj._append(new, from_policy=True)
        text = tokenizer.decode(new)
        traj.turns.append(text)
        traj.final_text = text
        if cut:
            traj.finish_reason = CONTEXT
            return traj
        calls = parse_tool_calls(text)
        if not calls:
            traj.finish_reason = STOP
            return traj
        if clock() >= deadline:
            traj.finish_reason = TIME
            return traj
        results = []
        for call in calls:
            result = tools(call)
            traj.num_tool_calls += 1
            traj.num_malformed += isinstance(call, MalformedCall) or result.malformed
            traj.num_successful += result.ok
            results.append(result)
            if result.aborted:
                traj.finish_reason = ABORTED
                return traj
        obs_ids = tokenizer.encode(observation(results))
        room = budget.max_context - len(traj.prompt_ids) - len(traj.response_ids)
        traj._append(obs_ids[:room], from_policy=False)
        steps += 1
        if len(obs_ids) >= room:
            traj.finish_reason = CONTEXT
            return traj
        if steps >= budget.max_steps:
            traj.finish_reason = MAX_STEPS
            return traj
        if clock() >= deadline:
            traj.finish_reason = TIME
            return traj

