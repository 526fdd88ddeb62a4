"""The climb's report: report.md with PNG plots (reward, held-out pass@1 overall, per suite, per
category and per task (categories "task:level" together), each with its gain and noise;
entropy against its target band, k / temperature, lengths, staleness, train-inference log-prob
gap) written from metrics.jsonl and the run's summary."""

from __future__ import annotations

import math
import os

import numpy as np

from hcjax.metrics import read_metrics

__all__ = ["NOISE_FORMULA", "entropy_within", "gain_noise", "mean_metric", "step_record",
           "suite_gain", "task_curves", "write_report"]

NOISE_FORMULA = ("noise = one binomial standard error of final - base pass@1 on n held-out "
                 "problems: sqrt(base (1 - base) / n + final (1 - final) / n)")


def gain_noise(base: float, final: float, n: int) -> float:
    """One binomial standard error of `final` − `base`, two pass@1 figures on `n` problems each,
    taken as independent (NOISE_FORMULA). Both are measured on the same problems, so this
    overstates the error of the paired difference when base and final mostly agree per problem."""
    if n < 1:
        raise ValueError(f"n={n} held-out problems: need at least one")
    for name, p in (("base", base), ("final", final)):
        if not 0.0 <= p <= 1.0:
            raise ValueError(f"{name}={p} is not a pass@1 in [0, 1]")
    return float(np.sqrt((base * (1.0 - base) + final * (1.0 - final)) / n))


def suite_gain(base: float, final: float, n: int | None) -> dict:
    """{"base", "final", "problems", "gain", "noise", "gain_over_noise"} of one suite's held-out
    pass@1 (noise and its ratio NaN without a problem count; the ratio infinite for a gain over
    zero noise, i.e. base and final both 0 or 1)."""
    gain = final - base
    noise = (gain_noise(base, final, n) if n and np.isfinite(base) and np.isfinite(final)
             else float("nan"))
    if noise > 0:
        ratio = gain / noise
    elif noise == 0 and gain != 0:
        ratio = math.copysign(math.inf, gain)
    else:
        ratio = math.nan
    return {"base": base, "final": final, "problems": n, "gain": gain, "noise": noise,
            "gain_over_noise": ratio}


def mean_metric(path: str, key: str) -> float:
    _, ys = _series(read_metrics(path), key)
    return float(np.mean(ys)) if ys else float("nan")


def entropy_within(path: str, target: float, warmup_fraction: float = 0.25,
                    smooth: int = 1) -> float:
    """Fraction of steps after warm-up (the first quarter) whose Ĥ is within ±25% of H*; with
    `smooth` > 1, Ĥ is first averaged over the last `smooth` steps (one step's estimate comes from
    a few hundred tokens and is noisy by itself)."""
    _, ys = _series(read_metrics(path), "entropy")
    if smooth > 1 and ys:
        csum = np.cumsum([0.0, *ys])
        ys = [(csum[i + 1] - csum[max(0, i + 1 - smooth)]) / min(i + 1, smooth)
              for i in range(len(ys))]
    warm = ys[int(len(ys) * warmup_fraction):]
    if not warm:
        return float("nan")
    return float(np.mean([abs(e - target) <= 0.25 * target for e in warm]))


def _series(records: list[dict], key: str, x: str = "step") -> tuple[list, list]:
    pts = [(r[x], r[key]) for r in records
           if key in r and x in r and np.isfinite(float(r[key]))]
    return ([p[0] for p in pts], [p[1] for p in pts]) if pts else ([], [])


def write_report(output_dir: str, summary: dict, entropy_target: float) -> str:
    """report.md with PNG plots of the climb (reward, pass@1, entropy, k, lengths, staleness,
    train-inference log-prob gap) from metrics.jsonl and the summary."""
    # optional: matplotlib (0.25 s to import), loaded only when a plot is written
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # after the Agg backend is chosen

    records = read_metrics(os.path.join(output_dir, "metrics.jsonl"))
    evals = summary.get("evals", [])
    plots: list[tuple[str, str]] = []

    def figure(name: str, title: str, draw) -> None:
        fig, ax = plt.subplots(figsize=(6, 3.6))
        draw(ax)
        ax.set_title(title)
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend()
        fig.tight_layout()
        fig.savefig(os.path.join(output_dir, name), dpi=90)
        plt.close(fig)
        plots.append((name, title))

    def reward_vs(x: str, xlabel: str):
        def draw(ax):
            xs, ys = _series(records, "reward_mean", x)
            ax.plot(xs, ys, label="train reward (mean)")
            ax.plot([e[x if x == "step" else "wall"] for e in evals],
                    [e["pass_at_1"] for e in evals], "o-", label="held-out pass@1")
            ax.set_xlabel(xlabel)
        return draw

    figure("reward_vs_step.png", "reward and held-out pass@1 vs step", reward_vs("step", "step"))
    categories = summary.get("categories") or {}
    tasks = task_curves(evals, categories)

    def per_key(field, counts=None):  # one curve per key of each evaluation's `field` dict,
        def plot(ax):  # with a band of one binomial standard error where n is known
            for key in sorted({k for e in evals for k in e.get(field, {})}):
                pts = [(e["step"], e[field][key]) for e in evals if key in e.get(field, {})]
                xs, ys = [p[0] for p in pts], np.array([p[1] for p in pts], dtype=float)
                line, = ax.plot(xs, ys, "o-", label=key)
                n = (counts or {}).get(key)
                if n:
                    se = np.sqrt(ys * (1.0 - ys) / n)
                    ax.fill_between(xs, ys - se, ys + se, alpha=0.15, color=line.get_color())
            ax.set_xlabel("step")
        return plot

    if len({c for e in evals for c in e.get("by_category", {})}) > 1:
        figure("pass_at_1_by_category.png", "held-out pass@1 by category (band: ±1 SE)",
               per_key("by_category", {c: v.get("problems") for c, v in categories.items()}))
    if tasks:
        evals = [{**e, "by_task": tasks["curves"].get(e["step"], {})} for e in evals]
        figure("pass_at_1_by_task.png", "held-out pass@1 by task (band: ±1 SE)",
               per_key("by_task", {t: v["problems"] for t, v in tasks["summary"].items()}))
    by_suite = sorted({name for e in evals for name in e.get("by_suite", {})})
    if by_suite:
        figure("pass_at_1_by_suite.png", "held-out pass@1 by suite", per_key("by_suite"))
    figure("reward_vs_wall.png", "reward and held-out pass@1 vs wall time",
           reward_vs("wall", "climb wall time (s)"))

    def entropy(ax):
        xs, ys = _series(records, "entropy")
        ax.plot(xs, ys, label="entropy estimate")
        if xs:
            ax.axhline(entropy_target, color="k", ls="--", label="target H*")
            ax.fill_between(xs, 0.75 * entropy_target, 1.25 * entropy_target, alpha=0.15,
                            label="H* +-25%")
        ax.set_xlabel("step")

    figure("entropy.png", "entropy vs target", entropy)
    levers = [("k", "k.png", "upper-clip offset k")]
    if _series(records, "temperature")[0]:
        levers.append(("temperature", "temperature.png", "sampling temperature (entropy lever)"))
    for key, name, title in [*levers,
                             ("response_len_mean", "lengths.png", "mean response length"),
                             ("logp_gap_mean", "logp_gap.png",
                              "train-inference log-prob gap (mean |diff|)")]:
        def draw(ax, key=key):
            xs, ys = _series(records, key)
            ax.plot(xs, ys, label=key)
            ax.set_xlabel("step")

        figure(name, title, draw)

    def hist(ax):
        h = summary.get("staleness_hist", {})
        ages = sorted(int(a) for a in h)
        ax.bar(ages, [h[str(a)] for a in ages])
        ax.set_xlabel("versions behind at training time")
        ax.set_ylabel("rollouts")

    figure("staleness.png", "staleness of trained rollouts", hist)
    keys = ("base_pass_at_1", "final_pass_at_1", "improvement", "steps", "wall_seconds",
            "climb_wall_seconds", "base_pretrain_seconds", "mode", "placement", "rollouts",
            "stale_rollouts_dropped", "learner_utilisation", "rollout_utilisation")
    within = summary.get("entropy_within_25pct", float("nan"))
    gaps = _series(records, "logp_gap_mean")[1]
    lines = ["# hcjax climb report", "", "| figure | value |", "|---|---|"]
    for k in keys:
        v = summary.get(k)
        lines.append(f"| {k} | {v:.4g} |" if isinstance(v, float) else f"| {k} | {v} |")
    lines.append(f"| entropy within +-25% of H*={entropy_target} after warm-up (fraction of "
                 f"steps) | {within:.3g} |")
    smoothed = summary.get("entropy_within_25pct_smoothed_10", float("nan"))
    lines.append(f"| same, Ĥ averaged over 10 steps | {smoothed:.3g} |")
    lines.append(f"| mean train-inference log-prob gap | "
                 f"{(float(np.mean(gaps)) if gaps else float('nan')):.3g} |")
    worker = summary.get("worker_stats") or {}
    if worker.get("template_episodes"):
        # Trained on the tokens sampled either way; drift says a re-rendered history differs.
        lines.append(f"| tool episodes whose chat-template re-rendering differs from the sampled "
                     f"tokens (template drift) | {worker.get('template_drift', 0)} of "
                     f"{worker['template_episodes']} |")
    lines += ["", "## Held-out pass@1", "", "| step | wall (s) | pass@1 |", "|---|---|---|"]
    lines += [f"| {e['step']} | {e['wall']:.1f} | {e['pass_at_1']:.3f} |" for e in evals]
    suites = summary.get("suites") or {}
    if suites:
        lines += ["", "## Held-out pass@1 by suite", "", NOISE_FORMULA + ".", "",
                  "| suite | problems | base | final | gain | noise | gain/noise |",
                  "|---|---|---|---|---|---|---|"]
        lines += [f"| {name} | {v.get('problems', '')} | {v['base']:.3f} | {v['final']:.3f} | "
                  f"{v['final'] - v['base']:+.3f} | {v.get('noise', float('nan')):.3f} | "
                  f"{v.get('gain_over_noise', float('nan')):.2f} |"
                  for name, v in sorted(suites.items())]
        evals_by_suite = [e for e in evals if e.get("by_suite")]
        if evals_by_suite:
            lines += ["", "| step | " + " | ".join(by_suite) + " |",
                      "|---|" + "---|" * len(by_suite)]
            lines += ["| {} | {} |".format(e["step"], " | ".join(
                f"{e['by_suite'][name]:.3f}" if name in e["by_suite"] else ""
                for name in by_suite)) for e in evals_by_suite]
    if tasks:
        names = sorted(tasks["summary"])
        lines += ["", "## Held-out pass@1 by task", "",
                  "A task's categories together (pass@1 weighted by their problems); "
                  "curve cells are pass@1 ± one binomial standard error, sqrt(p (1 - p) / n).", ""]
        lines += _gain_table("task", tasks["summary"])
        lines += ["", "| step | " + " | ".join(names) + " |", "|---|" + "---|" * len(names)]
        for e in evals:
            row = e.get("by_task", {})
            lines.append("| {} | {} |".format(e["step"], " | ".join(
                _with_se(row[t], tasks["summary"][t]["problems"]) if t in row else ""
                for t in names)))
    if categories:
        lines += ["", "## Held-out pass@1 by category", ""]
        lines += _gain_table("category", categories)
    extraction = summary.get("extraction") or {}
    if extraction:
        lines += ["", "## Answer extraction (held-out, final)", "", "| extraction | pass@1 |",
                  "|---|---|"]
        lines += [f"| {k} | {v:.3f} |" for k, v in sorted(extraction.items())]
    lines += [""] + [f"![{title}]({name})" for name, title in plots]
    text = "\n".join(lines) + "\n"
    path = os.path.join(output_dir, "report.md")
    with open(path, "w", encoding="utf-8") as f:
        f.write(text)
    return path


def _with_se(p: float, n: int | None) -> str:
    return f"{p:.3f} ± {math.sqrt(p * (1.0 - p) / n):.3f}" if n else f"{p:.3f}"


def _gain_table(what: str, rows: dict[str, dict]) -> list[str]:
    """Markdown rows: name, problems, base, final, gain, noise (NOISE_FORMULA), gain/noise."""
    out = [f"| {what} | problems | base | final | gain | noise | gain/noise |",
           "|---|---|---|---|---|---|---|"]
    for name, v in sorted(rows.items()):
        g = suite_gain(v["base"], v["final"], v.get("problems"))
        out.append(f"| {name} | {v.get('problems', '')} | {v['base']:.3f} | {v['final']:.3f} | "
                   f"{g['gain']:+.3f} | {g['noise']:.3f} | {g['gain_over_noise']:.2f} |")
    return out


def task_curves(evals: list[dict], categories: dict[str, dict]) -> dict:
    """Categories named "task:level" (e.g. a reasoning-gym dataset and its difficulty) grouped
    by task: {"summary": {task: {"problems", "base", "final"}}, "curves": {step: {task: pass@1}}},
    each pass@1 weighted by its categories' problem counts. Empty unless some task has more than
    one category (otherwise the category table already is the task table)."""
    groups: dict[str, list[str]] = {}
    for c in categories:
        groups.setdefault(c.split(":", 1)[0], []).append(c)
    if not any(len(cs) > 1 for cs in groups.values()):
        return {}
    n = {c: int(categories[c].get("problems") or 0) for c in categories}
    if not all(n.values()):
        return {}

    def weighted(values: dict[str, float], cs: list[str]) -> float | None:
        if not all(c in values for c in cs):
            return None
        return sum(values[c] * n[c] for c in cs) / sum(n[c] for c in cs)

    summary = {t: {"problems": sum(n[c] for c in cs),
                   "base": weighted({c: categories[c]["base"] for c in cs}, cs),
                   "final": weighted({c: categories[c]["final"] for c in cs}, cs)}
               for t, cs in groups.items()}
    curves = {}
    for e in evals:
        row = {t: weighted(e.get("by_category", {}), cs) for t, cs in groups.items()}
        curves[e["step"]] = {t: p for t, p in row.items() if p is not None}
    return {"summary": summary, "curves": curves}


def step_record(report, entropy_target: float, stats, counters, step_seconds: float,
                wall: float) -> dict:
    """The metrics line of one learner step: the batch's rewards and lengths, the learner's
    diagnostics, staleness, throughput and the controller's drop counters."""
    m = report.metrics
    rewards = [r.reward for g in report.groups for r in g.valid]
    lengths = [r.response_len for g in report.groups for r in g.valid]
    record = {
        "reward_mean": float(np.mean(rewards)) if rewards else float("nan"),
        "response_len_mean": float(np.mean(lengths)) if lengths else float("nan"),
        "entropy": m.get("entropy", float("nan")),
        "entropy_target": entropy_target,
        "k": m.get("k", float("nan")),
        "logp_gap_mean": m.get("logp_gap_mean", float("nan")),
        "logp_gap_max": m.get("logp_gap_max", float("nan")),
        "logp_exact_share": m.get("logp_exact_share", float("nan")),
        "fresh_token_share": m.get("fresh_token_share", float("nan")),
        "loss": m.get("loss", float("nan")),
        "grad_norm": m.get("grad_norm", float("nan")),
        "staleness_mean": float(np.mean(report.staleness)) if report.staleness else 0.0,
        "staleness_max": float(np.max(report.staleness)) if report.staleness else 0.0,
        "version": report.version,
        "step_seconds": step_seconds,
        "wall": wall,
        "rollouts_per_s": stats.rollouts / max(wall, 1e-9),
        "stale_rollouts_dropped": counters["stale_rollouts_dropped"],
        "early_dropped": stats.early_dropped,
        "full_dropped": stats.full_dropped,
        "failures": stats.failures,
    }
    if getattr(stats, "template_episodes", 0):  # tool episodes under a chat template so far
        record["template_episodes"] = stats.template_episodes
        record["template_drift"] = stats.template_drift
    # The learner's own diagnostics (clip fractions, ratio statistics, support misses, LB; the
    # rollout correction's when one is on: hcjax.rl.losses.rollout_correction).
    for key in ("clip_low_frac", "clip_high_frac", "clip_outer_frac", "ratio_mean", "ratio_max",
                "support_miss_frac", "load_balance_loss", "policy_loss", "is_clip_frac",
                "is_ratio_mean", "is_ratio_max", "is_weight_mean", "is_kl",
                "router_load_imbalance_max", "learner_step_s", "publish_blocked_s"):
        if key in m:
            record[key] = m[key]
    return record
