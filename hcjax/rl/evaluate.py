"""Held-out evaluation of the served policy through the same inference client and rollout worker
as training (one path for single-turn and tool episodes): greedy pass@1 overall, per category,
and per answer extraction where the suite's grades report several (strict / flexible)."""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Sequence
from concurrent import futures
from typing import Any

import numpy as np

from hcjax.rl.workers import RolloutWorker, SamplingConfig, WorkerStats

__all__ = ["HeldoutEval"]

EXTRACTION_KEYS = ("strict", "flexible")


EVAL_PRIORITY = 1  # GenerateRequest.priority of held-out evaluation requests


class HeldoutEval:
    """`evaluate()` -> {"pass_at_1", "by_category", "by_suite" (a mixture's components),
    "category_sizes", "extraction", "problems", "aborted"}.

    client: the climb's inference side; builder: its TaskBuilder (prompts in the tokenizer's chat
    template, the suite's grader and tools); sampling: the training sampling settings, made greedy
    (temperature 0, top-p 1, no partial rollouts) here. Its requests carry EVAL_PRIORITY: on a
    replica busy with training rollouts, the evaluation's lane gets twice their share of slots."""

    def __init__(self, client: Any, builder: Any, problems: Sequence[Any],
                 sampling: SamplingConfig, *, max_retries: int = 3, threads: int = 16) -> None:
        self.builder = builder
        self.problems = list(problems)
        self.tasks = [builder.task(p) for p in self.problems]
        greedy = SamplingConfig(max_tokens=sampling.max_tokens, temperature=0.0, top_p=1.0,
                                stop_tokens=sampling.stop_tokens, token_budget=None,
                                priority=EVAL_PRIORITY)
        self.worker = RolloutWorker(client, greedy, max_retries=max_retries, stats=WorkerStats())
        self.threads = threads

    def set_max_tokens(self, max_tokens: int) -> None:
        """Follow the length curriculum's current response budget."""
        s = self.worker.sampling
        self.worker.sampling = dataclasses.replace(s, max_tokens=max_tokens)

    def _one(self, task) -> tuple[bool, dict[str, float]]:
        rec = self.worker.run(task, 1, seed=0)[0]
        if rec.aborted:
            return False, {"aborted": 1.0}
        return bool(rec.reward_components.get("correct", 0.0) > 0), dict(rec.reward_components)

    def evaluate(self) -> dict[str, Any]:
        if not self.tasks:
            return {"pass_at_1": float("nan"), "by_category": {}, "by_suite": {},
                    "category_sizes": {}, "extraction": {},
                    "problems": 0, "aborted": 0}
        with futures.ThreadPoolExecutor(self.threads) as pool:
            results = list(pool.map(self._one, self.tasks))
        ok = np.array([r[0] for r in results], float)
        by_category: dict[str, list[float]] = collections.defaultdict(list)
        for p, v in zip(self.problems, ok, strict=True):
            by_category[p.category].append(float(v))
        by_suite: dict[str, list[float]] = collections.defaultdict(list)
        for p, v in zip(self.problems, ok, strict=True):
            if "/" in p.category:  # a mixture's "suite/category"
                by_suite[p.category.split("/", 1)[0]].append(float(v))
        extraction = {k: float(np.mean([r[1].get(k, 0.0) > 0 for r in results]))
                      for k in EXTRACTION_KEYS if any(k in r[1] for r in results)}
        return {"pass_at_1": float(ok.mean()),
                "by_category": {c: float(np.mean(v)) for c, v in sorted(by_category.items())},
                "category_sizes": {c: len(v) for c, v in sorted(by_category.items())},
                "by_suite": {s: float(np.mean(v)) for s, v in sorted(by_suite.items())},
                "extraction": extraction, "problems": len(self.tasks),
                "aborted": int(sum("aborted" in r[1] for r in results))}
