"""long2short (Kimi k1.5, RECIPE §5): how a long-response model and its shortened versions compare
on a held-out split: greedy pass@1 and mean response length per model, and whether each cuts the
length by `min_cut` at pass@1 within `max_drop` of the reference. `python -m hcjax.long2short`
is its entry point; the shortening methods are their own steps (merge, rejection + SFT, DPO, RL
with the length reward).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

from hcjax.display import Phases
from hcjax.model_io import load_model
from hcjax.rl.pass_at_1 import ModelEvaluator

__all__ = ["compare", "evaluate_runs"]


def compare(results: dict[str, dict[str, float]], *, min_cut: float = 0.25,
            max_drop: float = 0.02) -> dict[str, dict[str, Any]]:
    """Each model against the first one: length_cut = 1 − len/len_ref, pass_at_1_delta =
    pass − pass_ref, and passes = (length_cut >= min_cut and pass_at_1_delta >= −max_drop)."""
    names = list(results)
    ref = results[names[0]]
    out = {}
    for name in names:
        r = results[name]
        cut = 1.0 - r["mean_length"] / ref["mean_length"]
        delta = r["pass_at_1"] - ref["pass_at_1"]
        out[name] = {**r, "length_cut": cut, "pass_at_1_delta": delta,
                     "passes": name != names[0] and cut >= min_cut and delta >= -max_drop}
    return out


def evaluate_runs(checkpoints: Sequence[str], suite: Any, problems: Sequence[Any], *,
                  max_tokens: int, phases: Phases | None = None) -> dict[str, dict[str, float]]:
    """{name: {pass_at_1, mean_length, problems}} for each "NAME=DIR" (or DIR) of `checkpoints`,
    in order, on one engine (models of one config compile it once)."""
    results = {}
    evaluator = ModelEvaluator(max_tokens=max_tokens)
    phases = phases or Phases("hcjax.long2short", mode="off")
    with phases.phase(f"evaluating on {len(problems)} held-out problems",
                      total=len(checkpoints)) as phase:
        for item in checkpoints:
            name, _, directory = item.partition("=")
            if not directory:
                name, directory = os.path.basename(os.path.normpath(item)), item
            phase.now(name)
            model, _ = load_model(directory)
            result = evaluator.evaluate(model, suite, problems)
            results[name] = {k: result[k] for k in ("pass_at_1", "mean_length", "problems")}
            phase.advance()
    return results
