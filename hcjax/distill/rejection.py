"""Shortest rejection sampling (Kimi k1.5 long2short, RECIPE §5): sample k responses per problem
of a task suite, keep the shortest correct one, and write the kept conversations as a chat JSONL
set for `python -m hcjax.sft` (DataConfig.source = "chat_jsonl"). The samples come from the one
evaluator's in-process server (hcjax.rl.pass_at_1), prompted and graded as the climb's. No
training here.

`run_rejection` samples a suite's training problems with a run's params and writes
OUT/rejection.jsonl, and every sample (graded, with its length) to OUT/samples.jsonl, from which
`python -m hcjax.dpo --samples` forms preference pairs; `python -m hcjax.rejection` is its
command line (this module parses no flags).
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Sequence
from typing import Any

import numpy as np

from hcjax.data.template import stop_ids
from hcjax.data.tokenizer import ByteTokenizer
from hcjax.model_io import load_model
from hcjax.rl.pass_at_1 import ModelEvaluator, is_correct
from hcjax.rollout.request import SamplingOptions

__all__ = [
    "Sample",
    "rejection_conversations",
    "sample_suite",
    "sample_records",
    "shortest_correct",
]


@dataclasses.dataclass(frozen=True)
class Sample:
    text: str  # the decoded response, stop token removed
    length: int  # response tokens, stop token included
    correct: bool


def shortest_correct(samples: Sequence[Sample]) -> int | None:
    """Index of the shortest correct sample (the first of equals), None when none is correct."""
    ok = [i for i, s in enumerate(samples) if s.correct]
    return min(ok, key=lambda i: (samples[i].length, i)) if ok else None


def rejection_conversations(problems: Sequence[Any], samples: Sequence[Sequence[Sample]]
                            ) -> list[list[dict[str, str]]]:
    """One conversation (the problem's prompt messages + its shortest correct response) per
    problem that has a correct sample, in problem order."""
    if len(problems) != len(samples):
        raise ValueError(f"{len(problems)} problems but {len(samples)} sample lists")
    out = []
    for p, group in zip(problems, samples, strict=True):
        best = shortest_correct(group)
        if best is not None:
            out.append([*map(dict, p.messages), {"role": "assistant",
                                                  "content": group[best].text}])
    return out


def sample_records(problems: Sequence[Any], samples: Sequence[Sequence[Sample]]
                   ) -> list[dict[str, Any]]:
    """One JSON-able record per problem: {"id", "messages" (the prompt), "samples": [{"text",
    "length", "correct"}, ...]}, the layout of OUT/samples.jsonl."""
    if len(problems) != len(samples):
        raise ValueError(f"{len(problems)} problems but {len(samples)} sample lists")
    return [{"id": p.id, "messages": [*map(dict, p.messages)],
             "samples": [dataclasses.asdict(x) for x in group]}
            for p, group in zip(problems, samples, strict=True)]


def sample_suite(model: Any, suite: Any, problems: Sequence[Any], tok: Any = None, *, k: int = 1,
                 max_new_tokens: int = 32, temperature: float = 1.0, seed: int = 0
                 ) -> list[list[Sample]]:
    """k samples per problem from `model` at `temperature` with the whole distribution (top-p 1),
    each graded by `suite` (`hcjax.rl.pass_at_1.ModelEvaluator`: the climb's prompts, stop
    tokens and grading)."""
    tok = tok or ByteTokenizer()
    stops = stop_ids(tok)
    options = SamplingOptions(max_tokens=max_new_tokens, temperature=temperature, top_p=1.0,
                              stop_tokens=stops)
    with ModelEvaluator(tok=tok, sampling=options).serving(model, suite, problems, k=k,
                                                           seed=seed) as evaluator:
        groups = evaluator.samples()
    out = []
    for group in groups:
        samples = []
        for r in group:
            ids = r.response_ids.tolist()
            body = ids[:-1] if ids and ids[-1] in stops else ids
            samples.append(Sample(tok.decode(body), len(ids), is_correct(r)))
        out.append(samples)
    return out


def run_rejection(checkpoint: str, output_dir: str, suite: Any, *, k: int = 8,
                  num_problems: int = 256, first_problem: int = 0, max_new_tokens: int = 32,
                  temperature: float = 1.0, seed: int = 0) -> dict[str, Any]:
    """Sample `suite.train_problem(first_problem + i)` for i < num_problems k times with the
    params of `checkpoint` (any hcjax run) and write OUTPUT_DIR/rejection.jsonl (the kept
    conversations) and OUTPUT_DIR/samples.jsonl (every sample, `sample_records`). Returns the
    summary (also OUTPUT_DIR/rejection.json)."""
    model, _ = load_model(checkpoint)
    problems = [suite.train_problem(first_problem + i) for i in range(num_problems)]
    samples = sample_suite(model, suite, problems, k=k, max_new_tokens=max_new_tokens,
                           temperature=temperature, seed=seed)
    convs = rejection_conversations(problems, samples)
    os.makedirs(output_dir, exist_ok=True)
    path = os.path.join(output_dir, "rejection.jsonl")
    with open(path, "w", encoding="utf-8") as f:
        for c in convs:
            f.write(json.dumps({"messages": c}) + "\n")
    with open(os.path.join(output_dir, "samples.jsonl"), "w", encoding="utf-8") as f:
        for r in sample_records(problems, samples):
            f.write(json.dumps(r) + "\n")
    all_lengths = [s.length for g in samples for s in g]
    kept = [g[shortest_correct(g)].length for g in samples if shortest_correct(g) is not None]
    summary = {"checkpoint": os.path.abspath(checkpoint), "problems": num_problems, "k": k,
               "kept": len(convs), "out": path,
               "sample_pass_rate": float(np.mean([s.correct for g in samples for s in g])),
               "mean_sample_length": float(np.mean(all_lengths)),
               "mean_kept_length": float(np.mean(kept)) if kept else float("nan")}
    with open(os.path.join(output_dir, "rejection.json"), "w", encoding="utf-8") as f:
        json.dump(summary, f, indent=1)
    return summary
