"""bench.precision's climb column: each (sampler / learner dtype) x (replay, TIS) cell's exact gin
bindings, the binomial noise of a gain on a hand-computed case, and one run of the section on a
very small model (one base pre-trained by hcjax.sft, two cells of two climb steps each) whose
JSON has every figure; a cell whose climb fails is reported and the next one still runs."""

import json
import math
import subprocess
import sys

import pytest

from hcjax.bench.precision import CLIMB_CELLS, climb_bindings, climb_cell
from hcjax.rl.report import suite_gain
from tests.test_climb import REPO, TINY, env


def test_cells_and_their_bindings():
    assert CLIMB_CELLS == ("bf16_fp32.replay", "bf16_fp32.tis", "bf16_fp32.both",
                           "bf16_fp32.neither", "bf16_bf16.replay", "bf16_bf16.tis",
                           "bf16_bf16.both", "bf16_bf16.neither")
    assert climb_bindings("bf16_fp32.replay") == [
        'ModelConfig.dtype = "float32"', 'ClimbConfig.sampler_dtype = "bfloat16"',
        "LearnerConfig.replay_routing = True", "LearnerConfig.replay_top_p = True",
        'LossConfig.correction = "none"']
    assert climb_bindings("bf16_bf16.tis") == [
        'ModelConfig.dtype = "bfloat16"', 'ClimbConfig.sampler_dtype = "bfloat16"',
        "LearnerConfig.replay_routing = False", "LearnerConfig.replay_top_p = False",
        'LossConfig.correction = "tis"']
    assert climb_bindings("bf16_fp32.both")[2:] == [
        "LearnerConfig.replay_routing = True", "LearnerConfig.replay_top_p = True",
        'LossConfig.correction = "tis"']
    assert climb_bindings("bf16_bf16.neither")[2:] == [
        "LearnerConfig.replay_routing = False", "LearnerConfig.replay_top_p = False",
        'LossConfig.correction = "none"']
    with pytest.raises(ValueError, match="climb cell 'fp32_fp32.replay' is not one of"):
        climb_bindings("fp32_fp32.replay")


def test_noise_of_a_cell_gain_by_hand():
    # 200 held-out problems, 0.08 -> 0.335: sqrt((0.0736 + 0.222775) / 200) = 0.038495, gain/noise
    # = 0.255 / 0.038495 = 6.624
    g = suite_gain(0.08, 0.335, 200)
    assert g["noise"] == pytest.approx(math.sqrt((0.0736 + 0.222775) / 200), rel=1e-12)
    assert g["noise"] == pytest.approx(0.038495, abs=1e-6)
    assert g["gain_over_noise"] == pytest.approx(6.624, abs=1e-3)


def test_a_failed_climb_is_reported(tmp_path):
    (tmp_path / "bf16_fp32.tis").mkdir()  # an earlier climb's folder: not measured again
    row = climb_cell("bf16_fp32.tis", str(tmp_path / "base"), str(tmp_path), 1.0)
    assert not row["ok"] and "exists" in row["error"] and row["tis"] and not row["replay"]


@pytest.mark.slow
def test_climb_column_end_to_end(tmp_path):
    params = [*TINY, "ClimbConfig.num_steps = 2", "ClimbConfig.eval_every = 2",
              "ControllerConfig.num_workers = 2"]
    command = [sys.executable, "-m", "hcjax.bench.precision", "--climb_only",
               "--climb_minutes", "5", "--climb_dir", str(tmp_path),
               "--climb_cells", "bf16_fp32.replay,bf16_bf16.tis"]
    for p in params:
        command += ["--climb_gin_param", p]
    proc = subprocess.run(command, cwd=REPO, env=env(), capture_output=True, text=True,
                          timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    climbs = out["climbs"]
    assert climbs["base_checkpoint"] == str(tmp_path / "base")  # one base, made by hcjax.sft
    assert "sqrt(base (1 - base) / n + final (1 - final) / n)" in climbs["noise_formula"]
    cells = {c["cell"]: c for c in climbs["cells"]}
    assert list(cells) == ["bf16_fp32.replay", "bf16_bf16.tis"]
    for name, c in cells.items():
        assert c["ok"], c
        assert c["bindings"] == climb_bindings(name)
        assert c["steps"] == 2 and c["heldout_problems"] == 16  # ArithmeticSuite.num_heldout
        for key in ("base_pass_at_1", "final_pass_at_1"):
            assert 0.0 <= c[key] <= 1.0
        assert c["gain"] == pytest.approx(c["final_pass_at_1"] - c["base_pass_at_1"])
        b, f = c["base_pass_at_1"], c["final_pass_at_1"]
        assert c["noise"] == pytest.approx(math.sqrt((b * (1 - b) + f * (1 - f)) / 16))
        assert math.isfinite(c["logp_gap_mean"]) and c["climb_wall_seconds"] > 0
        # The climb ran the cell's dtypes (its summary, read back).
        s = json.loads((tmp_path / name / "summary.json").read_text())
        assert (s["sampler_dtype"], s["learner_dtype"]) == (c["sampler_dtype"],
                                                            c["learner_dtype"])
    # The bf16 sampler against the fp32 learner leaves a log-prob gap replay cannot close.
    assert cells["bf16_fp32.replay"]["logp_gap_mean"] > 1e-4
