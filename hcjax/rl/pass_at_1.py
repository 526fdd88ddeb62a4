"""pass@1 of a policy on task problems, the one evaluator: the climb's held-out figure (through the
climb's inference client), SFT's, consolidation's and long2short's (`ModelEvaluator`: in-process
servers over models), and the graded samples that rejection sampling keeps from. Problems are
`TaskProblem`s, prompted and graded by their suite exactly as the climb's rollouts are
(TaskBuilder, RolloutWorker); there is no decoding or grading of its own here."""

from __future__ import annotations

import collections
import contextlib
import dataclasses
from collections.abc import Iterator, Sequence
from concurrent import futures
from typing import Any

import numpy as np

from hcjax.data.problem import TaskProblem
from hcjax.data.template import response_answer, stop_ids
from hcjax.data.tokenizer import ByteTokenizer, Tokenizer
from hcjax.rl.sources import TaskBuilder
from hcjax.rl.workers import InferenceClient, RolloutWorker, WorkerStats
from hcjax.rollout.engine import Engine
from hcjax.rollout.offline import local_engine, local_server
from hcjax.rollout.records import Rollout
from hcjax.rollout.request import SamplingOptions

__all__ = [
    "EVAL_PRIORITY",
    "PassAt1",
    "evaluate_model",
    "ModelEvaluator",
    "greedy",
    "is_correct",
    "summarize",
]

EVAL_PRIORITY = 1  # GenerateRequest.priority of evaluation requests
EXTRACTION_KEYS = ("strict", "flexible")  # answer extractions a suite's grades may report
_GOLDEN = 0x9E3779B1  # spreads per-problem seeds so problems do not share key streams
_EXAMPLES = 5


def greedy(options: SamplingOptions) -> SamplingOptions:
    """`options` made evaluation's: temperature 0, top-p 1, whole responses (no partial
    rollouts) and EVAL_PRIORITY (on a replica busy with training rollouts, the evaluation's lane
    gets twice their share of slots); max_tokens and stop tokens are kept."""
    return dataclasses.replace(options.options(), temperature=0.0, top_p=1.0, seed=None,
                               token_budget=None, priority=EVAL_PRIORITY)


class PassAt1:
    """pass@1 of the policy behind `client` on `problems`: `evaluate()` -> `summarize`'s dict;
    `samples()` -> the graded records themselves.

    client: any inference client (the climb's LocalInference / RemoteInference, a RolloutServer
    such as `local_server`'s); builder: the problems' TaskBuilder (prompts in its tokenizer's chat
    template, its suite's grader and tools); sampling: how to sample (`greedy(...)` for pass@1 as
    the climb reports it); k samples per problem (1 when greedy), problem i seeded with
    seed + i * 0x9E3779B1. Requests go `threads` at a time through one RolloutWorker, so retries,
    partial rollouts and tool episodes run as in training.
    """

    def __init__(self, client: InferenceClient, builder: TaskBuilder,
                 problems: Sequence[TaskProblem], sampling: SamplingOptions, *, k: int = 1,
                 seed: int = 0, max_retries: int = 3, threads: int = 16) -> None:
        if k < 1 or (sampling.temperature == 0.0 and k != 1):
            raise ValueError(f"k={k} must be 1 when greedy (temperature 0) and >= 1 when "
                             f"sampling (temperature={sampling.temperature})")
        if threads < 1:
            raise ValueError(f"threads={threads} must be >= 1")
        self.builder = builder
        self.problems = list(problems)
        self.tasks = [builder.task(p) for p in self.problems]  # prompt-length errors come now
        self.worker = RolloutWorker(client, sampling, max_retries=max_retries,
                                    stats=WorkerStats())
        self.k, self.seed, self.threads = k, seed, threads

    def set_max_tokens(self, max_tokens: int) -> None:
        """Follow the length curriculum's current response budget."""
        self.worker.set_sampling(max_tokens=max_tokens)

    def samples(self) -> list[list[Rollout]]:
        """k graded records per problem, in problem order (aborted ones carry no reward)."""
        def run(i: int) -> list[Rollout]:
            return self.worker.run(self.tasks[i], self.k, seed=(self.seed + i * _GOLDEN) % 2**32)

        with futures.ThreadPoolExecutor(self.threads) as pool:
            return list(pool.map(run, range(len(self.tasks))))

    def evaluate(self) -> dict[str, Any]:
        return summarize(self.problems, self.samples(), self.builder.tok,
                         suite=getattr(self.builder.suite, "name", None))


def is_correct(record: Rollout) -> bool:
    """Whether a graded record's answer is right (an aborted record's is not)."""
    return not record.aborted and record.reward_components.get("correct", 0.0) > 0


def _text(record: Rollout, tok: Tokenizer) -> str | None:
    return None if record.aborted else tok.decode(record.response_ids.tolist())


def summarize(problems: Sequence[TaskProblem], samples: Sequence[Sequence[Rollout]],
              tok: Tokenizer, *, suite: str | None = None) -> dict[str, Any]:
    """{"pass_at_1": mean over problems of the fraction of correct samples (aborted samples are
    wrong), "problems", "samples" (per problem), "by_category" / "category_sizes" (pass@1 and
    problems per category), "by_suite" / "suite_sizes" (the same per member suite: a mixture's
    "suite/category" prefix; a category without one is `suite`'s, or no suite's when None),
    "extraction"
    (per answer extraction the grades report, e.g. strict / flexible: the fraction of samples
    it finds right), "format_rate" (samples with an answer the tokenizer's template reads,
    `response_answer`), "mean_length" (response tokens of the samples that were not aborted,
    stop token included), "aborted" (samples), "examples" (the first problems' first samples)}."""
    if len(problems) != len(samples):
        raise ValueError(f"{len(problems)} problems but {len(samples)} sample lists")
    if not problems:
        return {"pass_at_1": float("nan"), "problems": 0, "samples": 0, "by_category": {},
                "category_sizes": {}, "by_suite": {}, "suite_sizes": {}, "extraction": {},
                "format_rate": float("nan"), "mean_length": float("nan"), "aborted": 0,
                "examples": []}
    records = [r for group in samples for r in group]
    ok = np.array([np.mean([is_correct(r) for r in group]) for group in samples], float)
    by_category: dict[str, list[float]] = collections.defaultdict(list)
    by_suite: dict[str, list[float]] = collections.defaultdict(list)
    for p, v in zip(problems, ok, strict=True):
        by_category[p.category].append(float(v))
        if "/" in p.category:  # a mixture's "suite/category"
            by_suite[p.category.split("/", 1)[0]].append(float(v))
        elif suite is not None:
            by_suite[suite].append(float(v))
    extraction = {key: float(np.mean([r.reward_components.get(key, 0.0) > 0 for r in records]))
                  for key in EXTRACTION_KEYS if any(key in r.reward_components for r in records)}
    texts = [_text(r, tok) for r in records]
    lengths = [r.response_len for r in records if not r.aborted]
    examples = [{"id": p.id, "prompt": p.prompt, "response": _text(group[0], tok),
                 "correct": is_correct(group[0])}
                for p, group in zip(problems[:_EXAMPLES], samples, strict=False) if group]
    return {"pass_at_1": float(ok.mean()), "problems": len(problems),
            "samples": max(len(g) for g in samples),
            "by_category": {c: float(np.mean(v)) for c, v in sorted(by_category.items())},
            "category_sizes": {c: len(v) for c, v in sorted(by_category.items())},
            "by_suite": {s: float(np.mean(v)) for s, v in sorted(by_suite.items())},
            "suite_sizes": {s: len(v) for s, v in sorted(by_suite.items())},
            "extraction": extraction,
            "format_rate": float(np.mean([t is not None and response_answer(t, tok) is not None
                                          for t in texts])),
            "mean_length": float(np.mean(lengths)) if lengths else float("nan"),
            "aborted": sum(r.aborted for r in records), "examples": examples}


class ModelEvaluator:
    """pass@1 of models (nnx models in this process) through `local_server`s, one model at a
    time on one engine per model structure (class, config, parameter shapes): consolidation and
    long2short evaluate several models on several suites, and an engine's functions compile once
    for every model it serves. The engines, each holding the first parameters it was built from,
    live as long as the evaluator.

    sampling None: greedy, `max_tokens` response tokens, ending at the tokenizer's stop ids
    (ByteTokenizer when tok is None), as the climb samples. max_concurrent_decodes: the engine's
    slots, and the requests in flight.
    """

    def __init__(self, *, tok: Tokenizer | None = None, max_tokens: int = 32,
                 sampling: SamplingOptions | None = None,
                 max_concurrent_decodes: int = 64) -> None:
        self.tok = tok or ByteTokenizer()
        self.sampling = sampling or greedy(SamplingOptions(max_tokens=max_tokens,
                                                           stop_tokens=stop_ids(self.tok)))
        self.max_concurrent_decodes = max_concurrent_decodes
        self._engines: list[Engine] = []

    @contextlib.contextmanager
    def serving(self, model: Any, suite: Any, problems: Sequence[TaskProblem], *, k: int = 1,
                seed: int = 0) -> Iterator[PassAt1]:
        """A PassAt1 of `model` on `problems` of `suite`, its server stopped on exit."""
        engine = self._engine(model, suite, problems)
        with local_server(model, max_tokens=self.sampling.max_tokens,
                          max_prompt_len=engine.max_prefill_length, engine=engine,
                          max_queue=self.max_concurrent_decodes) as server:
            yield PassAt1(server, TaskBuilder(suite, self.tok), problems, self.sampling, k=k,
                          seed=seed, threads=self.max_concurrent_decodes)

    def _engine(self, model: Any, suite: Any, problems: Sequence[TaskProblem]) -> Engine:
        """An engine that serves `model` and holds the problems' longest prompt (the model's
        whole context for tool episodes, whose prompts grow) plus the response: a kept one, else
        a new one in place of those kept for this model's structure."""
        tools = any(suite.tools(p) is not None for p in problems)
        builder = TaskBuilder(suite, self.tok)
        longest = None if tools else max((len(builder.prompt_ids(p)) for p in problems),
                                         default=1)
        need = model.config.max_seq_len - self.sampling.max_tokens if tools else longest
        engine = next((e for e in self._engines
                       if e.serves(model) and e.max_prefill_length >= need), None)
        if engine is None:
            engine = local_engine(model, max_tokens=self.sampling.max_tokens,
                                  max_prompt_len=longest,
                                  max_concurrent_decodes=self.max_concurrent_decodes)
            self._engines = [e for e in self._engines if not e.serves(model)] + [engine]
        return engine

    def evaluate(self, model: Any, suite: Any, problems: Sequence[TaskProblem]) -> dict[str, Any]:
        """`summarize`'s dict for `model` on `problems` of `suite`."""
        with self.serving(model, suite, problems) as evaluator:
            return evaluator.evaluate()


def evaluate_model(model: Any, suite: Any, problems: Sequence[TaskProblem], *,
                   tok: Tokenizer | None = None, max_tokens: int = 32) -> dict[str, Any]:
    """Greedy pass@1 of one `model` on `problems` of `suite` (`summarize`'s dict), as the climb
    measures it."""
    return ModelEvaluator(tok=tok, max_tokens=max_tokens).evaluate(model, suite, problems)
