"""Rollout and problem workers (RECIPE §4): a rollout worker turns one problem into graded Rollout
records through any inference client; a problem worker runs early exit then the full group, and
returns the group with advantages. Plain records and callables only: no JAX, no model here.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

import numpy as np

from hcjax.envs import react
from hcjax.rewards.types import Grade
from hcjax.rl.advantages import assign_advantages
from hcjax.rl.curriculum import EarlyExit
from hcjax.rollout.records import Rollout
from hcjax.rollout.request import GenerateRequest, SampledRollout, SamplingOptions

__all__ = [
    "Grade",
    "GroupResult",
    "InferenceClient",
    "PartialRegistry",
    "ProblemWorker",
    "RolloutWorker",
    "Task",
    "WorkerStats",
]


class InferenceClient(Protocol):
    """Anything that answers a GenerateRequest with its records: an in-process RolloutServer, a
    gRPC RolloutClient or a Router (all three share this call)."""

    def generate(self, request: GenerateRequest, timeout: float | None = None) -> list: ...


@dataclasses.dataclass(frozen=True)
class Task:
    """One problem as the workers see it: its id, the prompt token ids and a grader of response
    token ids. `meta` is carried through untouched (e.g. the problem text, for the rollout store)."""

    id: str
    prompt_ids: tuple[int, ...]
    grade: Callable[[Sequence[int]], Grade]
    meta: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    # Multi-turn environments (hcjax.envs): a tool runner, the tokenizer that encodes its
    # observations, and the episode budget. None for single-turn tasks.
    tools: Callable[[Any], Any] | None = None
    tokenizer: Any = None
    budget: Any = None
    # Observations as the model's chat template writes tool messages (react.ChatTemplateTurns),
    # with a template-drift check per episode; None: plain-text observations.
    chat: Any = None
    # Group reward shaping (hcjax.rewards.spec through hcjax.rl.sources): graded rollouts of a
    # kept group -> the same rollouts with composed rewards, before advantages. None: as graded.
    shaping: Callable[[list[Rollout]], list[Rollout]] | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "prompt_ids", tuple(int(t) for t in self.prompt_ids))
        if not self.prompt_ids:
            raise ValueError(f"task {self.id!r} has an empty prompt")
        if self.tools is not None and self.tokenizer is None:
            raise ValueError(f"task {self.id!r} has tools but no tokenizer for observations")
        if self.chat is not None and self.tools is None:
            raise ValueError(f"task {self.id!r} has a chat template for observations but no tools")


@dataclasses.dataclass
class WorkerStats:
    """Counters shared by every worker of a controller (thread-safe through `add`)."""

    requests: int = 0
    rollouts: int = 0
    failures: int = 0  # requests or samples that failed and were retried (infrastructure errors)
    aborted: int = 0  # samples that came back aborted: retried, never counted as failures
    gave_up: int = 0  # samples still failed/aborted after every retry (kept out of the group)
    continuations: int = 0  # partial-rollout continuation calls
    early_dropped: int = 0
    full_dropped: int = 0
    kept: int = 0
    # Tool episodes under a chat template whose drift was checked, and those whose whole
    # re-rendering differs from the tokens sampled (react.Trajectory.template_drift).
    template_episodes: int = 0
    template_drift: int = 0
    _lock: threading.Lock = dataclasses.field(default_factory=threading.Lock, repr=False)

    def add(self, **counts: int) -> None:
        with self._lock:
            for name, n in counts.items():
                setattr(self, name, getattr(self, name) + n)

    def as_dict(self) -> dict[str, int]:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "_lock"}


class PartialRegistry:
    """Partial rollouts waiting for their continuation, by task id, so a checkpoint can save them
    and a restarted run can continue them instead of regenerating their tokens."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._by_task: dict[str, list[SampledRollout]] = {}

    def put(self, task_id: str, records: Sequence[SampledRollout]) -> None:
        with self._lock:
            if records:
                self._by_task[task_id] = list(records)
            else:
                self._by_task.pop(task_id, None)

    def take(self, task_id: str) -> list[SampledRollout]:
        with self._lock:
            return self._by_task.pop(task_id, [])

    def snapshot(self) -> dict[str, list[SampledRollout]]:
        with self._lock:
            return {k: list(v) for k, v in self._by_task.items()}

    def __len__(self) -> int:
        with self._lock:
            return sum(len(v) for v in self._by_task.values())


class RolloutWorker:
    """Samples n responses to a task, retries failed ones, continues partial ones, grades them.

    A request that raises, or a sample whose finish_reason is "error", counts as a failure and is
    retried; an "aborted" sample is retried without counting as a failure. Samples still failed
    after `max_retries` come back as they are (aborted records carry no reward and are kept out
    of group statistics by the advantage estimator). Every request carries `sampling`'s options
    with the seed that `run` is given (the options' own seed is not used).
    """

    def __init__(
        self,
        client: InferenceClient,
        sampling: SamplingOptions,
        *,
        max_retries: int = 3,
        timeout: float | None = None,
        stats: WorkerStats | None = None,
        partials: PartialRegistry | None = None,
    ) -> None:
        if max_retries < 0:
            raise ValueError(f"max_retries={max_retries} must be >= 0")
        self.client = client
        self.sampling = sampling
        self.max_retries = max_retries
        self.timeout = timeout
        self.stats = stats or WorkerStats()
        self.partials = partials or PartialRegistry()

    def set_sampling(self, **changes: Any) -> None:
        """Requests made from now on use these sampling settings (e.g. the entropy lever's
        temperature, the length curriculum's max_tokens); in-flight requests keep theirs."""
        self.sampling = dataclasses.replace(self.sampling, **changes)

    def _request(self, task: Task, n: int, seed: int | None) -> GenerateRequest:
        return GenerateRequest.of(self.sampling, prompt=task.prompt_ids, n=n, seed=seed,
                                  group_id=task.id, request_id=task.id)

    def _call(self, request: GenerateRequest) -> list[SampledRollout] | None:
        self.stats.add(requests=1)
        try:
            records = list(self.client.generate(request, timeout=self.timeout))
        except (RuntimeError, ConnectionError, TimeoutError, OSError) as err:
            del err  # infrastructure failure: the caller retries the whole request
            self.stats.add(failures=1)
            return None
        if len(records) != request.n:
            self.stats.add(failures=1)
            return None
        return records

    def _finish_partials(self, task: Task, records: list[SampledRollout]) -> list[SampledRollout]:
        """Continue partial samples (Kimi) until each one stops or reaches max_tokens."""
        while True:
            partial = [r for r in records if getattr(r, "partial", False)]
            if not partial:
                self.partials.put(task.id, [])
                return records
            self.partials.put(task.id, partial)
            request = GenerateRequest.continuation(partial, token_budget=self.sampling.token_budget)
            self.stats.add(continuations=1)
            more = None
            for _ in range(self.max_retries + 1):
                more = self._call(request)
                if more is not None:
                    break
            if more is None:  # give the partial samples up as aborted (never scored)
                more = [dataclasses.replace(r, finish_reason="aborted", partial=False)
                        for r in partial]
                self.stats.add(gave_up=len(more))
            by_index = {r.sample_index: r for r in more}
            records = [by_index.get(r.sample_index, r) if getattr(r, "partial", False) else r
                       for r in records]

    def run(self, task: Task, n: int, seed: int | None = None) -> list[Rollout]:
        """n graded records for `task` (in sample order); aborted ones carry no reward."""
        if n < 1:
            raise ValueError(f"n={n} must be >= 1")
        if task.tools is not None:
            graded = [self._grade(task, self._episode(task, None if seed is None else
                                                      (seed + 7919 * i) % 2**32))
                      for i in range(n)]
            self.stats.add(rollouts=len(graded))
            return graded
        resumed = self.partials.take(task.id)
        done: list[SampledRollout] = []
        if resumed:  # a restarted run continues the partial samples saved by its checkpoint
            done = self._finish_partials(task, resumed)[:n]
        todo = n - len(done)
        attempt = 0
        while todo > 0:
            sub_seed = None if seed is None else (seed + 7919 * attempt) % 2**32
            records = self._call(self._request(task, todo, sub_seed))
            if records is not None:
                records = self._finish_partials(task, records)
                good = [r for r in records if r.finish_reason not in ("error", "aborted")]
                errors = sum(r.finish_reason == "error" for r in records)
                aborted = sum(r.finish_reason == "aborted" for r in records)
                self.stats.add(failures=errors, aborted=aborted)
                done += good
                todo -= len(good)
                bad = [r for r in records if r.finish_reason in ("error", "aborted")]
            else:
                bad = []
            attempt += 1
            if todo > 0 and attempt > self.max_retries:
                # Keep the last failed samples as aborted placeholders so group sizes stay known.
                filler = [dataclasses.replace(r, finish_reason="aborted") for r in bad][:todo]
                self.stats.add(gave_up=todo)
                done += filler
                break
        graded = [self._grade(task, r) for r in done]
        self.stats.add(rollouts=len(graded))
        return graded

    def _episode(self, task: Task, seed: int | None) -> Rollout:
        """One multi-turn ReAct episode (hcjax.envs.react): each model turn is one request on
        the whole sequence so far; tool observations enter with loss mask 0, no log-prob, version
        -1. The record's routing is the last turn's (it covers every earlier token)."""
        turns: list[SampledRollout] = []

        class _Failed(Exception):
            pass

        def policy(ids: Sequence[int]) -> list[int]:
            # One whole turn per request: a tool episode has no partial rollouts.
            request = GenerateRequest.of(
                self.sampling, prompt=tuple(ids), n=1, token_budget=None,
                seed=None if seed is None else (seed + len(turns)) % 2**32,
                group_id=task.id, request_id=task.id)
            for _ in range(self.max_retries + 1):
                records = self._call(request)
                if records is not None and records[0].finish_reason not in ("error", "aborted"):
                    turns.append(records[0])
                    return records[0].response_ids.tolist()
            raise _Failed

        budget = task.budget or react.Budget()
        try:
            traj = react.run_episode(task.prompt_ids, policy, task.tokenizer, task.tools, budget,
                                     chat=task.chat)
        except _Failed:
            self.stats.add(gave_up=1)
            traj = None
        if traj is not None and traj.template_drift is not None:
            self.stats.add(template_episodes=1, template_drift=int(traj.template_drift))
        if traj is None or traj.aborted or not traj.response_ids:
            one = np.zeros(1)
            return Rollout(prompt_ids=task.prompt_ids, response_ids=[0], logprobs=one,
                           n_kept=one, threshold_logit=one, loss_mask=[False], versions=[-1],
                           finish_reason="aborted", group_id=task.id)
        return _glue_turns(task, traj, turns)

    @staticmethod
    def _grade(task: Task, record: Rollout) -> Rollout:
        if record.aborted:
            return dataclasses.replace(record, reward=None, group_id=task.id)
        g = task.grade(record.response_ids.tolist())
        if g.aborted:  # the grader could not judge (e.g. a sandbox failure): not a wrong answer
            return dataclasses.replace(record, reward=None, finish_reason="aborted",
                                       group_id=task.id)
        components = dict(g.components)
        components["correct"] = float(g.correct)
        return dataclasses.replace(record, reward=float(g.reward), reward_components=components,
                                   group_id=task.id)


def _glue_turns(task: Task, traj, turns: Sequence[SampledRollout]) -> Rollout:
    """A Rollout from a ReAct trajectory and the records of its model turns, in order."""
    r = len(traj.response_ids)
    mask = np.asarray(traj.loss_mask, bool)
    logprobs = np.zeros(r, np.float32)
    n_kept = np.zeros(r, np.int32)
    threshold = np.zeros(r, np.float32)
    versions = np.full(r, -1, np.int32)
    pos, turn = 0, 0
    while pos < r:  # policy segments, in order, are the turns' responses (maybe cut at the end)
        if not mask[pos]:
            pos += 1
            continue
        end = pos
        while end < r and mask[end]:
            end += 1
        rec = turns[turn]
        k = end - pos
        logprobs[pos:end] = rec.logprobs[:k]
        n_kept[pos:end] = rec.n_kept[:k]
        threshold[pos:end] = rec.threshold_logit[:k]
        versions[pos:end] = rec.versions[:k]
        pos, turn = end, turn + 1
    last = turns[-1] if turns else None
    routing = None
    if last is not None and last.routing is not None and mask[-1]:
        routing = last.routing[:, : len(task.prompt_ids) + r - 1]
    reason = {"stop": "stop", "aborted": "aborted"}.get(traj.finish_reason, "length")
    return Rollout(prompt_ids=task.prompt_ids, response_ids=traj.response_ids,
                   logprobs=logprobs, n_kept=n_kept, threshold_logit=threshold, loss_mask=mask,
                   versions=versions, finish_reason=reason, routing=routing,
                   temperature=last.temperature if last is not None else 1.0, group_id=task.id)


@dataclasses.dataclass
class GroupResult:
    """One problem's graded group. `kept` is False when the early-exit filter dropped it (the
    rollouts are still returned, for statistics and the rollout store)."""

    task: Task
    rollouts: list[Rollout]
    kept: bool
    pass_rate: float
    stage: str  # "early" when dropped after the early samples, else "full"

    @property
    def valid(self) -> list[Rollout]:
        return [r for r in self.rollouts if not r.aborted]


def _pass_rate(rollouts: Sequence[Rollout]) -> float:
    valid = [r for r in rollouts if not r.aborted]
    if not valid:
        return 0.0
    return sum(r.reward_components.get("correct", 0.0) > 0 for r in valid) / len(valid)


def _in(window: tuple[float, float], rate: float) -> bool:
    return window[0] <= rate <= window[1]


class ProblemWorker:
    """Runs one problem: G_early samples, the early-exit window, then the rest of the G samples and
    the full window (RECIPE §3); computes group advantages (aborted samples excluded)."""

    def __init__(
        self,
        rollout_worker: RolloutWorker,
        early_exit: EarlyExit,
        *,
        advantage: str = "mean_std",
        stats: WorkerStats | None = None,
    ) -> None:
        self.rollout_worker = rollout_worker
        self.early_exit = early_exit
        self.advantage = advantage
        self.stats = stats or rollout_worker.stats

    def run(self, task: Task, seed: int | None = None) -> GroupResult:
        ee = self.early_exit
        rollouts = self.rollout_worker.run(task, ee.g_early, seed)
        # Pass rates are over valid (non-aborted) samples: an infrastructure failure is no answer.
        rate = _pass_rate(rollouts)
        if not _in(ee.early_window, rate):
            self.stats.add(early_dropped=1)
            return GroupResult(task, rollouts, False, rate, "early")
        if ee.g > ee.g_early:
            more_seed = None if seed is None else (seed + 104729) % 2**32
            rollouts += self.rollout_worker.run(task, ee.g - ee.g_early, more_seed)
        rate = _pass_rate(rollouts)
        if not _in(ee.full_window, rate):
            self.stats.add(full_dropped=1)
            return GroupResult(task, rollouts, False, rate, "full")
        self.stats.add(kept=1)
        if task.shaping is not None:
            rollouts = task.shaping(rollouts)
        return GroupResult(task, assign_advantages(rollouts, self.advantage), True, rate, "full")
