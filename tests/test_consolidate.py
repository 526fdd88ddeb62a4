"""Consolidation: the SFT mix's counts exactly, the mix built from rollout stores, and (slow) two
tiny specialist climbs (addition, subtraction) from one base consolidated end to end."""

import json
import subprocess
import sys

import pytest

from hcjax.distill.consolidation import ConsolidateConfig, build_mix, mix_counts
from hcjax.rl.store import rollout_to_json
from hcjax.rollout.records import Rollout
from tests.test_climb import REPO, TINY, climb, env


def test_mix_counts_exact():
    assert mix_counts([10, 4]) == [4, 4]  # equal shares, limited by the smaller climb
    assert mix_counts([10, 4], [3, 1]) == [10, 3]  # T = min(10/.75, 4/.25) = 13.3
    assert mix_counts([10, 4], [0.75, 0.25]) == [10, 3]  # weights are normalised
    assert mix_counts([5, 0], [1, 0]) == [5, 0]  # a zero-weight climb holds nothing back
    assert mix_counts([10, 10, 10], total=10) == [4, 3, 3]  # largest remainder, earlier first
    assert mix_counts([10, 10], [1, 3], total=6) == [2, 4]  # 1.5 / 4.5: tie to the earlier
    with pytest.raises(ValueError, match="source 1 needs 5, holds 4"):
        mix_counts([10, 4], total=10)
    with pytest.raises(ValueError, match="weights=\\[1\\] must be 2"):
        mix_counts([1, 2], [1])


def _rollout(ok):
    return Rollout(prompt_ids=[1, 2], response_ids=[3, 4], logprobs=[-1.0, -1.0], n_kept=[2, 2],
                   threshold_logit=[0.0, 0.0], loss_mask=[1, 1], versions=[0, 0],
                   finish_reason="stop", reward=float(ok), reward_components={"correct": float(ok)})


def _store(path, groups):
    """groups: (step, prompt, [(text, correct), ...])."""
    (path / "rollouts").mkdir(parents=True)
    lines = [json.dumps({"task_id": prompt, "accepted": True, "pass_rate": 0.5, "stage": "full",
                         "step": step, "version": step, "meta": {}, "prompt_text": prompt,
                         "response_texts": [t for t, _ in rs],
                         "rollouts": [rollout_to_json(_rollout(ok)) for _, ok in rs]})
             for step, prompt, rs in groups]
    (path / "rollouts" / "groups.jsonl").write_text("\n".join(lines) + "\n")


def test_build_mix_from_stores(tmp_path):
    from hcjax.tasks import ArithmeticSuite

    _store(tmp_path / "a", [(0, "early", [("e", True)]),
                            *[(4, f"a{i}", [(f"ok{i}", True), ("bad", False)]) for i in range(3)]])
    _store(tmp_path / "b", [(4, "b0", [("x", True), ("y", True), ("z", False)])])
    cfg = ConsolidateConfig(min_step_fraction=0.5, base_fraction=0.2)
    union = ArithmeticSuite(kinds=("add",), max_digits=1)
    convs, mix = build_mix([str(tmp_path / "a"), str(tmp_path / "b")], cfg, union)
    # a: 3 late successes (the step-0 one is filtered), b: 2; equal shares -> 2 + 2; base data
    # round(4 * 0.2 / 0.8) = 1.
    assert mix == {"available": [3, 2], "taken": [2, 2], "base": 1}
    assert len(convs) == 5
    answers = sorted(c[1]["content"] for c in convs)
    assert sum(a.startswith("ok") for a in answers) == 2 and {"x", "y"} <= set(answers)
    assert "bad" not in answers and "e" not in answers


@pytest.mark.slow
def test_two_specialists_consolidate_end_to_end(tmp_path):
    """Base (800 SFT steps: about 0.2 pass@1, so that rollouts of both climbs succeed) -> add
    and sub climbs -> consolidate (mix, SFT, union climb, report). About 75 s on two CPU cores."""
    base = tmp_path / "base"
    args = [sys.executable, "-m", "hcjax.sft", "--output_dir", str(base)]
    for p in [*TINY, "TrainerConfig.num_steps = 800", "ArithmeticSuite.kinds = ('add', 'sub')",
              "run_sft.eval_problems = 0"]:
        args += ["--gin_param", p]
    proc = subprocess.run(args, cwd=REPO, env=env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    for kind in ("add", "sub"):
        climb(tmp_path / kind, 3, "--base_checkpoint", str(base),
              "--gin_param", f"ArithmeticSuite.kinds = ('{kind}',)")
    out = tmp_path / "consolidated"
    args = [sys.executable, "-m", "hcjax.consolidate", "--gin_file", "consolidate_tiny.gin",
            "--climb", str(tmp_path / "add"), "--climb", str(tmp_path / "sub"),
            "--base_checkpoint", str(base), "--output_dir", str(out), "--quiet"]
    for p in [*TINY, "ClimbConfig.num_steps = 2", "ClimbConfig.max_minutes = None",
              "ConsolidateConfig.min_step_fraction = 0.0", "ConsolidateConfig.eval_problems = 8",
              "TrainerConfig.num_steps = 3"]:
        args += ["--gin_param", p]
    proc = subprocess.run(args, cwd=REPO, env=env(), capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads((out / "report.json").read_text())
    assert report["mix"]["taken"][0] == report["mix"]["taken"][1] > 0
    assert set(report["eval"]) == {"base", "specialist:add", "specialist:sub",
                                   "consolidated_sft", "consolidated_rl"}
    for per in report["eval"].values():
        assert set(per) == {"add", "sub"}
        assert all(0.0 <= v["pass_at_1"] <= 1.0 and v["problems"] == 8 for v in per.values())
    assert report["sft"]["steps"] == 3 and report["rl"]["steps"] == 2
    assert "| consolidated_rl |" in (out / "report.md").read_text()
    for name in ("sft_mix.jsonl", "config.gin", "operative_config.gin", "sft/checkpoints",
                 "rl/summary.json"):
        assert (out / name).exists(), name
