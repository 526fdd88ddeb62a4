"""hcjax.rl.report's per-suite figures: the binomial noise of a pass@1 gain on a hand-computed
case, and report.md's per-suite table (problems, base, final, gain, noise, gain/noise), per-step
suite rows and curve, written from synthetic metrics and a synthetic summary."""

import json
import math
from pathlib import Path

import pytest

from hcjax.rl.report import NOISE_FORMULA, gain_noise, suite_gain, write_report


def test_gain_noise_by_hand():
    # sqrt((0.2 * 0.8 + 0.5 * 0.5) / 100) = sqrt(0.0041) = 0.0640312...
    assert gain_noise(0.2, 0.5, 100) == pytest.approx(0.06403124, abs=1e-8)
    # Symmetric in base and final; 0 when both are certain.
    assert gain_noise(0.5, 0.2, 100) == gain_noise(0.2, 0.5, 100)
    assert gain_noise(0.0, 1.0, 10) == 0.0
    with pytest.raises(ValueError, match="n=0 held-out problems"):
        gain_noise(0.2, 0.5, 0)
    with pytest.raises(ValueError, match="final=1.5 is not a pass@1"):
        gain_noise(0.2, 1.5, 10)
    g = suite_gain(0.2, 0.5, 100)
    assert g["gain"] == pytest.approx(0.3) and g["problems"] == 100
    assert g["gain_over_noise"] == pytest.approx(0.3 / 0.06403124, rel=1e-6)  # 4.685
    assert g["gain_over_noise"] == pytest.approx(4.6852, abs=1e-4)
    assert math.isinf(suite_gain(0.0, 1.0, 5)["gain_over_noise"])
    assert math.isnan(suite_gain(0.2, 0.5, None)["noise"])


def test_report_has_the_per_suite_table_and_curve(tmp_path):
    (tmp_path / "metrics.jsonl").write_text(
        "".join(json.dumps({"step": s, "reward_mean": 0.1 * s}) + "\n" for s in (1, 2)))
    evals = [{"step": 0, "wall": 0.0, "pass_at_1": 0.3, "by_category": {},
              "by_suite": {"arithmetic": 0.2, "code": 0.4}},
             {"step": 2, "wall": 5.0, "pass_at_1": 0.45, "by_category": {},
              "by_suite": {"arithmetic": 0.5, "code": 0.4}}]
    summary = {"evals": evals,
               "suites": {"arithmetic": suite_gain(0.2, 0.5, 100),
                          "code": suite_gain(0.4, 0.4, 100)}}
    text = Path(write_report(str(tmp_path), summary, 0.3)).read_text()
    assert "## Held-out pass@1 by suite" in text and NOISE_FORMULA in text
    assert "| suite | problems | base | final | gain | noise | gain/noise |" in text
    # arithmetic: noise sqrt((0.16 + 0.25) / 100) = 0.064, gain/noise 4.69; code: no gain,
    # noise sqrt(2 * 0.24 / 100) = 0.069.
    assert "| arithmetic | 100 | 0.200 | 0.500 | +0.300 | 0.064 | 4.69 |" in text
    assert "| code | 100 | 0.400 | 0.400 | +0.000 | 0.069 | 0.00 |" in text
    # Every evaluation's per-suite figures, and their curve.
    assert "| step | arithmetic | code |" in text
    assert "| 0 | 0.200 | 0.400 |" in text and "| 2 | 0.500 | 0.400 |" in text
    assert (tmp_path / "pass_at_1_by_suite.png").is_file()
    assert "![held-out pass@1 by suite](pass_at_1_by_suite.png)" in text


def test_report_plots_pass_at_1_by_category(tmp_path):
    (tmp_path / "metrics.jsonl").write_text(json.dumps({"step": 1, "reward_mean": 0.1}) + "\n")
    evals = [{"step": s, "wall": float(s), "pass_at_1": 0.3,
              "by_category": {"add": 0.2 + 0.1 * s, "mul": 0.4}} for s in (0, 2)]
    write_report(str(tmp_path), {"evals": evals}, 0.3)
    assert (tmp_path / "pass_at_1_by_category.png").is_file()
    assert not (tmp_path / "pass_at_1_by_suite.png").exists()  # no suites recorded


def test_report_groups_a_tasks_levels_with_noise(tmp_path):
    """Categories "task:level" (a reasoning-gym dataset and its difficulty) are summed into one
    row per task, weighted by their problems, with gain, noise and a curve of p ± its SE."""
    (tmp_path / "metrics.jsonl").write_text(json.dumps({"step": 1, "reward_mean": 0.1}) + "\n")
    evals = [{"step": 0, "wall": 0.0, "pass_at_1": 0.2,
              "by_category": {"sum:d=1": 0.5, "sum:d=2": 0.0, "mul": 0.1}},
             {"step": 10, "wall": 9.0, "pass_at_1": 0.5,
              "by_category": {"sum:d=1": 0.75, "sum:d=2": 0.5, "mul": 0.3}}]
    categories = {"sum:d=1": {"problems": 40, "base": 0.5, "final": 0.75},
                  "sum:d=2": {"problems": 60, "base": 0.0, "final": 0.5},
                  "mul": {"problems": 50, "base": 0.1, "final": 0.3}}
    text = Path(write_report(str(tmp_path), {"evals": evals, "categories": categories},
                             0.3)).read_text()
    # sum: base (0.5 * 40 + 0 * 60) / 100 = 0.2, final (30 + 30) / 100 = 0.6; noise
    # sqrt((0.16 + 0.24) / 100) = 0.063, gain/noise 0.4 / 0.0632 = 6.32. mul (one category):
    # sqrt((0.09 + 0.21) / 50) = 0.0775, 0.2 / 0.0775 = 2.58.
    assert "| sum | 100 | 0.200 | 0.600 | +0.400 | 0.063 | 6.32 |" in text
    assert "| mul | 50 | 0.100 | 0.300 | +0.200 | 0.077 | 2.58 |" in text
    # curve cells: p ± sqrt(p (1 - p) / n): 0.2 ± 0.040 on 100, 0.1 ± 0.042 on 50
    assert "| step | mul | sum |" in text
    assert "| 0 | 0.100 ± 0.042 | 0.200 ± 0.040 |" in text
    assert "| 10 | 0.300 ± 0.065 | 0.600 ± 0.049 |" in text
    # every category keeps its own row, now with its gain and noise
    assert "| sum:d=2 | 60 | 0.000 | 0.500 | +0.500 | 0.065 | 7.75 |" in text
    assert (tmp_path / "pass_at_1_by_task.png").is_file()


def test_no_task_table_when_every_task_has_one_category(tmp_path):
    (tmp_path / "metrics.jsonl").write_text(json.dumps({"step": 1, "reward_mean": 0.1}) + "\n")
    categories = {"add": {"problems": 10, "base": 0.1, "final": 0.2},
                  "sub": {"problems": 10, "base": 0.3, "final": 0.3}}
    evals = [{"step": 0, "wall": 0.0, "pass_at_1": 0.2, "by_category": {"add": 0.1, "sub": 0.3}}]
    text = Path(write_report(str(tmp_path), {"evals": evals, "categories": categories},
                             0.3)).read_text()
    assert "by task" not in text and not (tmp_path / "pass_at_1_by_task.png").exists()
    # sqrt((0.09 + 0.16) / 10) = 0.158, 0.1 / 0.158 = 0.63
    assert "| add | 10 | 0.100 | 0.200 | +0.100 | 0.158 | 0.63 |" in text
