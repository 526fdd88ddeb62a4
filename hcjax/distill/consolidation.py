"""Consolidation (RECIPE §3): several specialist climbs into one model. One SFT of a base on the
successful late rollouts of every climb, mixed by per-climb weights, then one RL climb over the
union of their task suites, and a report of held-out pass@1 of the base, each specialist and the
consolidated model on every suite. The union suite is gin's `TaskConfig.suite`, a MixtureSuite
whose i-th component is the i-th climb's suite. `python -m hcjax.consolidate` is its entry point.
"""

from __future__ import annotations

import dataclasses
import json
import os
import random
import time
from collections.abc import Sequence
from typing import Any

import gin

from hcjax import sharding as shd
from hcjax.display import Phase, Phases
from hcjax.model import ModelConfig
from hcjax.model_io import load_model, run_tokenizer
from hcjax.rl.climber import Climb
from hcjax.rl.pass_at_1 import ModelEvaluator
from hcjax.rl.store import distillation_conversations
from hcjax.rollout.request import sampling_options_from_gin
from hcjax.tasks.task_config import TaskConfig
from hcjax.train.pipeline import DataConfig
from hcjax.train.sft import sft_trainer

__all__ = ["ConsolidateConfig", "build_mix", "mix_counts", "run_consolidate", "write_report"]


@gin.configurable
@dataclasses.dataclass(frozen=True)
class ConsolidateConfig:
    """weights: each climb's share of the SFT mix's rollouts (None: equal shares, RECIPE's
    sample-weight-balanced mix). max_examples: rollouts in the mix (None: the most the shares
    allow from what the climbs hold). min_step_fraction, max_per_prompt: the late-checkpoint
    filter and per-prompt cap of `hcjax.rl.store.distillation_conversations` (successful rollouts
    only). base_fraction: share of the final mix taken from the union suite's reference
    responses (the base's own data). rl: run the union climb after the SFT (its length is
    ClimbConfig.num_steps / max_minutes). eval_problems: held-out problems per suite in the
    report; eval_max_tokens: None means SamplingOptions.max_tokens."""

    weights: Sequence[float] | None = None
    max_examples: int | None = None
    min_step_fraction: float = 0.5
    max_per_prompt: int | None = None
    base_fraction: float = 0.0
    rl: bool = True
    eval_problems: int = 200
    eval_max_tokens: int | None = None
    seed: int = 0

    def __post_init__(self) -> None:
        if not 0.0 <= self.base_fraction < 1.0:
            raise ValueError(f"ConsolidateConfig.base_fraction={self.base_fraction} is not in "
                             "[0, 1)")
        if self.max_examples is not None and self.max_examples < 1:
            raise ValueError(f"ConsolidateConfig.max_examples={self.max_examples} must be >= 1")
        if self.eval_problems < 1:
            raise ValueError(f"ConsolidateConfig.eval_problems={self.eval_problems} must be >= 1")


def mix_counts(available: Sequence[int], weights: Sequence[float] | None = None,
               total: int | None = None) -> list[int]:
    """How many examples to take from each source so that the counts follow `weights`
    (normalised; None: equal) without taking more than a source holds.

    total=None: the largest mix the weights allow, n_i = ⌊T·p_i⌋ with T = min_i available_i/p_i
    over sources with p_i > 0. Otherwise exactly `total` by largest remainders (ties to the
    earlier source); a ValueError when some source holds too few."""
    n = len(available)
    if n == 0:
        raise ValueError("mix_counts: no sources")
    w = [1.0] * n if weights is None else [float(x) for x in weights]
    if len(w) != n or any(x < 0 for x in w) or sum(w) <= 0:
        raise ValueError(f"weights={weights} must be {n} non-negative numbers with a positive sum")
    p = [x / sum(w) for x in w]
    if total is None:
        cap = min(a / q for a, q in zip(available, p, strict=True) if q > 0)
        # A tiny epsilon keeps ⌊cap·p_i⌋ from landing one below an exact integer.
        return [int(cap * q + 1e-9) if q > 0 else 0 for q in p]
    exact = [total * q for q in p]
    counts = [int(x) for x in exact]
    order = sorted(range(n), key=lambda i: (-(exact[i] - counts[i]), i))
    for i in order[: total - sum(counts)]:
        counts[i] += 1
    short = [(i, c, a) for i, (c, a) in enumerate(zip(counts, available, strict=True)) if c > a]
    if short:
        raise ValueError("the mix needs more rollouts than some climbs hold: " + "; ".join(
            f"source {i} needs {c}, holds {a}" for i, c, a in short))
    return counts


def _store(climb_dir: str) -> str:
    path = os.path.join(climb_dir, "rollouts")
    if not os.path.isdir(path):
        raise FileNotFoundError(f"--climb {climb_dir!r} has no rollouts/ store")
    return path


def build_mix(climbs: Sequence[str], cfg: ConsolidateConfig, union: Any = None
              ) -> tuple[list[list[dict[str, str]]], dict[str, Any]]:
    """The SFT conversations: successful late rollouts of each climb (`mix_counts` of them, each
    a uniform sample) plus `base_fraction` of reference conversations of `union`'s training
    problems; shuffled. Returns (conversations, per-source counts)."""

    pools = [distillation_conversations(_store(d), successful_only=True,
                                        min_step_fraction=cfg.min_step_fraction,
                                        max_per_prompt=cfg.max_per_prompt, seed=cfg.seed + i)
             for i, d in enumerate(climbs)]
    counts = mix_counts([len(p) for p in pools], cfg.weights, cfg.max_examples)
    if sum(counts) == 0:
        raise ValueError(f"no successful rollout passes the filter in {list(climbs)} "
                         f"(min_step_fraction={cfg.min_step_fraction})")
    convs = [c for pool, n in zip(pools, counts, strict=True) for c in pool[:n]]
    n_base = 0
    if cfg.base_fraction > 0:
        if union is None:
            raise ValueError("ConsolidateConfig.base_fraction > 0 needs the union suite")
        n_base = round(len(convs) * cfg.base_fraction / (1.0 - cfg.base_fraction))
        # Training problems far past those a climb draws, so the base data are fresh ones.
        convs += [union.train_problem(10_000_000 + i).conversation() for i in range(n_base)]
    random.Random(cfg.seed).shuffle(convs)
    return convs, {"available": [len(p) for p in pools], "taken": counts, "base": n_base}


def _components(suite: Any, n: int) -> list[Any]:
    parts = list(getattr(suite, "suites", ())) or [suite]
    if len(parts) != n:
        raise ValueError(f"TaskConfig.suite has {len(parts)} component suite(s) "
                         f"({[s.name for s in parts]}) for {n} --climb folder(s); give a "
                         "MixtureSuite whose i-th suite is the i-th climb's")
    return parts


def _run_sft(output_dir: str, mix_path: str, base: str) -> dict[str, Any]:
    """SFT of `base` (any hcjax run, with its tokenizer) on the chat JSONL mix, with gin's
    TrainerConfig / AdamWConfig / ModelConfig / DataConfig (source and path replaced). Resumes
    from OUTPUT_DIR's checkpoints."""

    mesh = shd.make_mesh(shd.MeshConfig())
    model_cfg = ModelConfig()
    model, _ = load_model(base, mesh, model_cfg)
    data_cfg = dataclasses.replace(DataConfig(), source="chat_jsonl", path=mix_path, suite=None)
    trainer = sft_trainer(output_dir, model_cfg, data_cfg, mesh, model=model,
                          tok=run_tokenizer(base))
    try:
        result = trainer.train()
    finally:
        trainer.close()
    return {"steps": result.steps, "final_loss": result.final_loss, "wall_s": result.wall_s}


def _evaluate(models: dict[str, str], suites: Sequence[Any], cfg: ConsolidateConfig,
              max_tokens: int, phase: Phase | None = None
              ) -> dict[str, dict[str, dict[str, float]]]:
    """{model name: {suite name: {"pass_at_1", "mean_length", "problems"}}}; each (model, suite)
    is a step of `phase`."""

    phase = phase or Phase("evaluating")
    evaluator = ModelEvaluator(max_tokens=max_tokens)  # one engine for models of one config
    out: dict[str, dict[str, dict[str, float]]] = {}
    for name, directory in models.items():
        phase.now(name)
        model, _ = load_model(directory)
        out[name] = {}
        for s in suites:
            phase.now(f"{name} on {s.name}")
            result = evaluator.evaluate(model, s, list(s.heldout())[: cfg.eval_problems])
            out[name][s.name] = {k: result[k] for k in ("pass_at_1", "mean_length", "problems")}
            phase.advance()
    return out


def write_report(output_dir: str, report: dict[str, Any]) -> str:
    """OUTPUT_DIR/report.json and report.md (a pass@1 table: one row per model, one column per
    suite, and each suite's best specialist)."""
    with open(os.path.join(output_dir, "report.json"), "w", encoding="utf-8") as f:
        json.dump(report, f, indent=1)
    evals = report["eval"]
    suites = list(next(iter(evals.values())))
    lines = ["# Consolidation", "", f"Climbs: {', '.join(report['climbs'])}",
             f"SFT mix: {report['mix']}", "", "## Held-out pass@1 (greedy; mean length in tokens)",
             "", "| model | " + " | ".join(suites) + " |",
             "|---|" + "---|" * len(suites)]
    for model, per in evals.items():
        cells = [f"{per[s]['pass_at_1']:.3f} ({per[s]['mean_length']:.1f})" for s in suites]
        lines.append(f"| {model} | " + " | ".join(cells) + " |")
    text = "\n".join(lines) + "\n"
    with open(os.path.join(output_dir, "report.md"), "w", encoding="utf-8") as f:
        f.write(text)
    return text


def run_consolidate(output_dir: str, climbs: Sequence[str], base: str | None = None,
                    progress: bool = True, phases: Phases | None = None) -> dict[str, Any]:
    """Mix → SFT (OUTPUT_DIR/sft) → union climb (OUTPUT_DIR/rl) → report. `base`: the SFT's
    starting checkpoint (any hcjax run; default the first climb's pre-trained OUT/base).
    phases: where each of them shows as a phase (default: nowhere)."""

    phases = phases or Phases("hcjax.consolidate", mode="off")
    t0 = time.perf_counter()
    cfg = ConsolidateConfig()
    union = TaskConfig().make_suite()
    suites = _components(union, len(climbs))
    base = base or os.path.join(climbs[0], "base")
    if not os.path.isdir(base):
        raise FileNotFoundError(f"base {base!r} does not exist; pass --base_checkpoint (the "
                                "specialists' common base)")
    os.makedirs(output_dir, exist_ok=True)
    mix_path = os.path.join(output_dir, "sft_mix.jsonl")
    with phases.phase(f"mixing the SFT data of {len(climbs)} climbs"):
        convs, mix = build_mix(climbs, cfg, union)
        with open(mix_path, "w", encoding="utf-8") as f:
            for c in convs:
                f.write(json.dumps({"messages": c}) + "\n")
    if progress:
        print(json.dumps({"event": "mix", **mix}), flush=True)
    with phases.phase(f"SFT of the base on {len(convs)} conversations"):
        sft = _run_sft(os.path.join(output_dir, "sft"), mix_path, base)
    if progress:
        print(json.dumps({"event": "sft", **sft}), flush=True)
    models = {"base": base, **{f"specialist:{s.name}": d
                               for s, d in zip(suites, climbs, strict=True)},
              "consolidated_sft": os.path.join(output_dir, "sft")}
    rl_summary = None
    if cfg.rl:
        rl_dir = os.path.join(output_dir, "rl")
        # The climb shows its own panel on a terminal: the phase only announces it.
        with phases.phase("union climb", redraw=False):
            rl_summary = Climb(rl_dir, base_checkpoint=models["consolidated_sft"],
                               progress=progress).run().summary
        models["consolidated_rl"] = rl_dir
    with phases.phase("evaluating", total=len(models) * len(suites)) as phase:
        max_tokens = cfg.eval_max_tokens or sampling_options_from_gin().max_tokens
        evals = _evaluate(models, suites, cfg, max_tokens, phase)
    report = {"climbs": [os.path.abspath(d) for d in climbs], "base": os.path.abspath(base),
              "mix": mix, "sft": sft, "models": models, "eval": evals,
              "rl": None if rl_summary is None else {
                  k: rl_summary[k] for k in ("base_pass_at_1", "final_pass_at_1", "steps",
                                             "suites")},
              "wall_seconds": time.perf_counter() - t0}
    text = write_report(output_dir, report)
    if progress:
        print(text, flush=True)
    return report
