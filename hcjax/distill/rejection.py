"""Shortest rejection sampling (Kimi k1.5 long2short, RECIPE §5): sample k responses per problem
of a task suite, keep the shortest correct one, and write the kept conversations as a chat JSONL
set for `python -m hcjax.sft` (DataConfig.source = "chat_jsonl"). Also the suite sampler the other
after-the-climb steps evaluate with (`sample_suite`, `evaluate_suite`: greedy pass@1 and mean
response length per suite, graded by the suite's own grader). No training here.

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

from hcjax.model_io import load_model

__all__ = [
    "Sample",
    "evaluate_suite",
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
                 max_new_tokens: int = 32, temperature: float = 0.0, seed: int = 0,
                 batch_size: int = 256) -> list[list[Sample]]:
    """k samples per problem (`hcjax.eval.generate` from the chat-template prompt, as the climb
    prompts), each graded by `suite.grade`. Greedy when temperature == 0 (then k must be 1)."""
    from hcjax.data.template import messages_prompt_ids, stop_ids
    from hcjax.data.tokenizer import ByteTokenizer
    from hcjax.eval import generate

    if k < 1 or (temperature == 0.0 and k != 1):
        raise ValueError(f"k={k} must be 1 for greedy sampling and >= 1 when sampling")
    tok = tok or ByteTokenizer()
    stops = set(stop_ids(tok))
    jobs = [p for p in problems for _ in range(k)]
    flat: list[Sample] = []
    for start in range(0, len(jobs), batch_size):
        chunk = jobs[start: start + batch_size]
        outs = generate(model, [messages_prompt_ids(p.messages, tok) for p in chunk],
                        max_new_tokens, tuple(stops), temperature, seed=seed + start)
        for p, ids in zip(chunk, outs, strict=True):
            body = ids[:-1] if ids and ids[-1] in stops else ids
            text = tok.decode(body)
            flat.append(Sample(text, len(ids), bool(suite.grade(p, text).correct)))
    return [flat[i * k: (i + 1) * k] for i in range(len(problems))]


def evaluate_suite(model: Any, suite: Any, problems: Sequence[Any], tok: Any = None, *,
                   max_new_tokens: int = 32) -> dict[str, float]:
    """Greedy pass@1 and mean response length (tokens) on `problems` of `suite`."""
    samples = [g[0] for g in sample_suite(model, suite, problems, tok,
                                          max_new_tokens=max_new_tokens)]
    return {"pass_at_1": float(np.mean([s.correct for s in samples])),
            "mean_length": float(np.mean([s.length for s in samples])),
            "problems": len(samples)}


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
