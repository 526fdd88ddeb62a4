"""The controller (RECIPE §4): feeds problems to problem workers, receives graded groups, enforces
the staleness bound, forms learner batches, steps the learner and publishes weights every N steps.

One code path for both placements: the learner, the weight publisher and the inference client are
plain callables/objects handed in, so the same controller drives an in-process engine or remote
servers. `mode="on_policy"` makes generation wait for every update (a debugging baseline).
"""

from __future__ import annotations

import collections
import dataclasses
import queue
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent import futures
from typing import Any, Protocol

import gin

from hcjax.rl.workers import GroupResult, ProblemWorker, Task, WorkerStats
from hcjax.rollout.records import Rollout

__all__ = [
    "Controller",
    "ControllerConfig",
    "Learner",
    "StepReport",
    "TaskSource",
    "oldest_version",
    "staleness",
]

MODES = ("async", "on_policy")


@gin.configurable
@dataclasses.dataclass(frozen=True)
class ControllerConfig:
    """groups_per_batch: kept groups per gradient step. sync_every: steps between weight pushes (N,
    RECIPE §3: 5). max_staleness: a rollout whose oldest policy token is more than this many
    inference versions old is dropped (M: 8). max_inflight: groups being generated or waiting in
    the buffer (bounds memory and staleness); None = 2 batches. On-policy mode pushes weights
    after every step and starts generating only once they are served."""

    groups_per_batch: int = 8
    sync_every: int = 5
    max_staleness: int = 8
    mode: str = "async"
    num_workers: int = 8
    max_inflight: int | None = None
    seed: int = 0
    max_worker_errors: int = 10

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"ControllerConfig.mode={self.mode!r} is not one of {MODES}")
        for name in ("groups_per_batch", "sync_every", "num_workers"):
            if getattr(self, name) < 1:
                raise ValueError(f"ControllerConfig.{name}={getattr(self, name)} must be >= 1")
        if self.max_staleness < 0:
            raise ValueError(f"ControllerConfig.max_staleness={self.max_staleness} must be >= 0")
        if self.max_inflight is not None and self.max_inflight < self.groups_per_batch:
            raise ValueError(
                f"ControllerConfig.max_inflight={self.max_inflight} is below groups_per_batch="
                f"{self.groups_per_batch}: a batch could never fill"
            )

    @property
    def inflight_limit(self) -> int:
        if self.mode == "on_policy":
            return self.groups_per_batch
        return self.max_inflight or 2 * self.groups_per_batch

    @property
    def push_every(self) -> int:
        return 1 if self.mode == "on_policy" else self.sync_every


# `Learner.train`'s policy_version when the learner's weights have not been served (it stepped
# since the last push): no rollout token was sampled by them.
UNSERVED = -1


class Learner(Protocol):
    """What the controller needs from a learner: one gradient step on graded rollouts (those it
    cannot use it leaves out), returning host metrics. hcjax.rl.learner.Learner implements it,
    and hcjax.rl.multihost.DistributedLearner for a learner over several processes."""

    def train(self, rollouts: Sequence[Rollout], policy_version: int | None = None
              ) -> Mapping[str, float]: ...


class TaskSource(Protocol):
    """Where problems come from (a sampler); its state is checkpointed with the controller's."""

    def next_task(self) -> Task: ...

    def update(self, group: GroupResult) -> None: ...

    def state_dict(self) -> dict: ...

    def load_state_dict(self, state: Mapping[str, Any]) -> None: ...


def oldest_version(rollout: Rollout) -> int | None:
    """The oldest policy version among the rollout's sampled tokens (None if it has none)."""
    v = rollout.versions[rollout.versions >= 0]
    return int(v.min()) if v.size else None


def staleness(rollout: Rollout, version: int) -> int:
    """How many inference versions behind `version` the rollout's oldest policy token is."""
    oldest = oldest_version(rollout)
    return 0 if oldest is None else version - oldest


@dataclasses.dataclass
class StepReport:
    """What one gradient step did: learner metrics plus the batch's and the controller's figures."""

    step: int
    version: int  # inference version after this step's push (if any)
    metrics: dict[str, float]
    groups: list[GroupResult]
    staleness: list[int]  # of every rollout trained on


class Controller:
    """Drives problems -> groups -> batches -> learner steps -> weight pushes.

    learner.train(rollouts) runs one step; publish(version) makes the learner's current weights
    the inference side's `version` (blocking until served). on_group(group, accepted, step,
    version) sees every finished group with the controller's step and version (e.g. the rollout
    store); on_step(report) runs after each step (metrics, eval,
    checkpoints) and may return True to stop.
    """

    def __init__(
        self,
        cfg: ControllerConfig,
        source: TaskSource,
        worker: ProblemWorker,
        learner: Learner,
        publish: Callable[[int], None],
        *,
        on_group: Callable[[GroupResult, bool, int, int], None] | None = None,
        on_step: Callable[[StepReport], bool | None] | None = None,
        stats: WorkerStats | None = None,
    ) -> None:
        self.cfg = cfg
        self.source = source
        self.worker = worker
        self.learner = learner
        self.publish = publish
        self.on_group = on_group
        self.on_step = on_step
        self.stats = stats or worker.stats
        self.step = 0
        self.version = 0
        # The version the learner's current weights were published as; None after a step
        # that published nothing (the learner is ahead of every served version).
        self.learner_version: int | None = 0
        self.buffer: collections.deque[GroupResult] = collections.deque()
        self.accepted_total = 0  # groups accepted into the buffer, ever
        self.accepted_consumed = 0  # of those, trained on or dropped as stale (FIFO prefix)
        self.counters = collections.Counter()
        self._tasks_issued = 0
        self._lock = threading.Lock()
        # Time accounting for utilisation: generation busy = at least one group in flight.
        self.learner_seconds = 0.0
        self.publish_seconds = 0.0  # the learner blocked by weight pushes (after its steps)
        self.pushes = 0
        self.steps_timed = 0
        self.generation_busy_seconds = 0.0  # closed busy intervals
        self._busy_since: float | None = None  # start of the open one, if any
        self.wall_seconds = 0.0

    # State -----------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        return {
            "step": self.step,
            "version": self.version,
            "accepted_total": self.accepted_total,
            "accepted_consumed": self.accepted_consumed,
            "tasks_issued": self._tasks_issued,
            "counters": dict(self.counters),
            "source": self.source.state_dict(),
        }

    def load_state_dict(self, state: Mapping[str, Any], pending: Sequence[GroupResult] = ()) -> None:
        """Restore counters and the sampler; `pending` are the accepted groups not yet consumed
        (read back from the rollout store), which go back into the buffer in order."""
        self.step = int(state["step"])
        self.version = int(state["version"])
        self.learner_version = None  # until the restored weights are published
        self.accepted_consumed = int(state["accepted_consumed"])
        self.accepted_total = self.accepted_consumed + len(pending)
        self._tasks_issued = int(state.get("tasks_issued", 0))
        self.counters = collections.Counter(state.get("counters", {}))
        self.source.load_state_dict(state["source"])
        self.buffer = collections.deque(pending)

    # Loop ------------------------------------------------------------------------------------
    def _seed(self) -> int:
        return (self.cfg.seed * 1_000_003 + self._tasks_issued * 7919) % 2**32

    def _accept(self, group: GroupResult) -> None:
        """A finished group: record it; kept ones enter the buffer unless already too stale."""
        self.source.update(group)
        self.counters["groups_finished"] += 1
        fresh = group.kept and any(
            staleness(r, self.version) <= self.cfg.max_staleness for r in group.valid
        )
        if group.kept and not fresh:
            self.counters["stale_groups_dropped"] += 1
            self.counters["stale_rollouts_dropped"] += len(group.valid)
        if self.on_group is not None:
            self.on_group(group, fresh, self.step, self.version)
        if fresh:
            self.buffer.append(group)
            self.accepted_total += 1

    def _take_batch(self) -> tuple[list[GroupResult], list[Rollout], list[int]]:
        """Pop groups_per_batch groups; drop (and count) rollouts past the staleness bound."""
        groups, rollouts, ages = [], [], []
        for _ in range(self.cfg.groups_per_batch):
            group = self.buffer.popleft()
            self.accepted_consumed += 1
            groups.append(group)
            for r in group.valid:
                age = staleness(r, self.version)
                if age > self.cfg.max_staleness:
                    self.counters["stale_rollouts_dropped"] += 1
                    continue
                rollouts.append(r)
                ages.append(age)
        return groups, rollouts, ages

    def _train(self) -> bool:
        groups, rollouts, ages = self._take_batch()
        if not rollouts:  # every rollout was stale: nothing to learn from, no step
            self.counters["empty_batches"] += 1
            return False
        t0 = time.perf_counter()
        served = UNSERVED if self.learner_version is None else self.learner_version
        metrics = dict(self.learner.train(rollouts, policy_version=served))
        t1 = time.perf_counter()
        self.learner_seconds += t1 - t0
        self.steps_timed += 1
        metrics["learner_step_s"] = t1 - t0
        self.step += 1
        self.learner_version = None  # stepped: weights no version has served yet
        if self.step % self.cfg.push_every == 0:
            self.version += 1
            self.publish(self.version)
            self.learner_version = self.version
            blocked = time.perf_counter() - t1
            self.publish_seconds += blocked
            self.pushes += 1
            metrics["publish_blocked_s"] = blocked
        report = StepReport(self.step, self.version, metrics, groups, ages)
        stop = self.on_step(report) if self.on_step is not None else False
        return bool(stop)

    def push_final(self) -> int:
        """Publish the learner's current weights as a new version (the last push may lag the
        learner by up to `push_every - 1` steps); returns that version."""
        self.version += 1
        self.publish(self.version)
        self.learner_version = self.version
        return self.version

    def run(self, num_steps: int, stop: threading.Event | None = None) -> None:
        """Run until `num_steps` gradient steps in total have been taken (or `stop` is set)."""
        cfg = self.cfg
        stop = stop or threading.Event()
        done: queue.Queue = queue.Queue()
        inflight: set[futures.Future] = set()
        worker_errors = 0
        start = time.perf_counter()
        pool = futures.ThreadPoolExecutor(cfg.num_workers, thread_name_prefix="problem-worker")

        def submit() -> None:
            task = self.source.next_task()
            fut = pool.submit(self.worker.run, task, self._seed())
            self._tasks_issued += 1
            fut.add_done_callback(done.put)
            if not inflight and self._busy_since is None:
                self._busy_since = time.perf_counter()
            inflight.add(fut)

        def settle(fut: futures.Future) -> None:
            inflight.discard(fut)
            if not inflight:
                self._close_busy()

        try:
            while self.step < num_steps and not stop.is_set():
                while len(self.buffer) >= cfg.groups_per_batch and self.step < num_steps:
                    if self._train():
                        stop.set()
                        break
                if stop.is_set() or self.step >= num_steps:
                    break
                while len(inflight) + len(self.buffer) < cfg.inflight_limit:
                    submit()
                fut = done.get()
                settle(fut)
                try:
                    group = fut.result()
                except Exception as err:  # a worker bug or a grader crash: count, then give up
                    worker_errors += 1
                    self.counters["worker_errors"] += 1
                    if worker_errors > cfg.max_worker_errors:
                        raise RuntimeError(
                            f"{worker_errors} problem workers failed; last error: {err!r}"
                        ) from err
                    continue
                self._accept(group)
        finally:
            stop.set()
            for fut in inflight:
                fut.cancel()
            pool.shutdown(wait=True, cancel_futures=True)
            self._close_busy()
            self.wall_seconds += time.perf_counter() - start

    def _close_busy(self) -> None:
        with self._lock:
            if self._busy_since is not None:
                self.generation_busy_seconds += time.perf_counter() - self._busy_since
                self._busy_since = None

    def generation_busy_now(self) -> float:
        """Seconds generation has had work in flight so far, the open interval included (the
        live display reads this while `run` goes on; in the asynchronous climb the in-flight set
        rarely empties, so the closed intervals alone stay at 0)."""
        with self._lock:
            open_s = 0.0 if self._busy_since is None else time.perf_counter() - self._busy_since
            return self.generation_busy_seconds + open_s

    def utilisation(self) -> dict[str, float]:
        """Fractions of wall time the learner stepped and generation had work in flight."""
        wall = max(self.wall_seconds, 1e-9)
        push_mean = self.publish_seconds / max(1, self.pushes)
        step_mean = self.learner_seconds / max(1, self.steps_timed)
        return {
            "learner_utilisation": self.learner_seconds / wall,
            "rollout_utilisation": self.generation_busy_seconds / wall,
            "publish_seconds": self.publish_seconds,
            # per push, the seconds the learner waited for it, and that over a learner step
            "publish_blocked_s_mean": push_mean,
            "publish_blocked_over_step": push_mean / step_mean if self.steps_timed else 0.0,
        }
