"""`python -m hcjax.climb` end to end on a very small model: base pre-training, on-policy climb
(train-inference log-prob gap), every output file, resume to more steps, and a kill -9 mid-run
whose restart loses no accepted group."""

import fcntl
import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import jax
import numpy as np
import pytest
from flax import nnx

from hcjax.config import cpu_xla_flags
from hcjax.model import ModelConfig
from hcjax.model_io import load_model
from hcjax.rl.store import main as store_main
from hcjax.rl.store import read_groups
from hcjax.sharding import MeshConfig, make_mesh
from tests.test_profiling import trace_files

REPO = Path(__file__).resolve().parent.parent

# A model and task small enough that a climb step takes well under a second on one CPU core.
TINY = [
    "ModelConfig.d_model = 32", "ModelConfig.num_layers = 2", "ModelConfig.num_heads = 2",
    "ModelConfig.num_kv_heads = 1", "ModelConfig.head_dim = 16",
    "ModelConfig.attention_pattern = ('local', 'global')", "ModelConfig.window = 16",
    "ModelConfig.d_ff = 64", "ModelConfig.num_experts = 4", "ModelConfig.moe_latent_dim = 16",
    "ModelConfig.moe_d_ff = 32", "ModelConfig.max_seq_len = 64",
    "ArithmeticSuite.kinds = ('add',)", "ArithmeticSuite.max_digits = 1",
    "ArithmeticSuite.num_heldout = 16",
    "TrainerConfig.num_steps = 4", "TrainerConfig.batch_size = 8",
    "DataConfig.row_len = 64",
    "ClimbConfig.group = 4", "ClimbConfig.early_group = 2",
    "ClimbConfig.early_window = (0.0, 1.0)", "ClimbConfig.full_window = (0.0, 1.0)",
    "SamplingOptions.max_tokens = 12", "ClimbConfig.eval_every = 2", "ClimbConfig.eval_problems = 16",
    "ClimbConfig.max_concurrent_decodes = 16", "ClimbConfig.checkpoint_every = 1",
    "ClimbConfig.max_minutes = None",
    "ControllerConfig.groups_per_batch = 2", "ControllerConfig.num_workers = 4",
    "ControllerConfig.max_inflight = None",
    "ControllerConfig.sync_every = 2", "LearnerConfig.seq_len = 64",
]


TINY_MODEL = dict(
    vocab_size=272, d_model=32, num_layers=2, num_heads=2, num_kv_heads=1, head_dim=16,
    attention_pattern=("local", "global"), window=16, d_ff=64, num_experts=4, moe_latent_dim=16,
    moe_d_ff=32, max_seq_len=64, dtype="float32",
)


# What pre-training the tiny base reads (hcjax.sft's configurables); the climb's own bindings
# do not change the base.
SFT_CONFIGURABLES = ("ModelConfig", "DataConfig", "TrainerConfig", "AdamWConfig",
                     "ArithmeticSuite")


def shared_base(params=TINY) -> Path:
    """The base `python -m hcjax.climb` would pre-train for `params` into OUTPUT_DIR/base,
    pre-trained once per test run (by `python -m hcjax.sft`, as the climb runs it) into the
    run-wide folder tests/conftest.py makes, under a file lock, so that every xdist worker's
    climb tests that do not test pre-training start from the same one (--base_checkpoint).
    The folder is named by the bindings, so a base matches the model it is loaded into."""
    bindings = [p for p in params if p.startswith(SFT_CONFIGURABLES)]
    key = hashlib.sha256("\n".join(bindings).encode()).hexdigest()[:12]
    base = Path(os.environ["HCJAX_TEST_RUN_DIR"], f"tiny-base-{key}")
    with open(f"{base}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        if not base.is_dir():
            partial = Path(f"{base}.partial")
            shutil.rmtree(partial, ignore_errors=True)  # a failed attempt's
            args = [sys.executable, "-m", "hcjax.sft", "--output_dir", str(partial)]
            for b in [*bindings, "run_sft.eval_problems = 0"]:
                args += ["--gin_param", b]
            proc = subprocess.run(args, cwd=REPO, env=env(), capture_output=True, text=True,
                                  timeout=300)
            assert proc.returncode == 0, proc.stderr[-3000:]
            partial.rename(base)  # complete, or absent
    return base


def command(out_dir, steps, *extra):
    params = [*TINY, f"ClimbConfig.num_steps = {steps}"]
    args = [sys.executable, "-m", "hcjax.climb", "--output_dir", str(out_dir), "--quiet"]
    for p in params:
        args += ["--gin_param", p]
    return args + list(extra)


def env():
    e = dict(os.environ)
    e["XLA_FLAGS"] = cpu_xla_flags(2)
    e["JAX_PLATFORMS"] = "cpu"
    return e


def climb(out_dir, steps, *extra, timeout=400):
    proc = subprocess.run(command(out_dir, steps, *extra), cwd=REPO, env=env(),
                          capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads((Path(out_dir) / "summary.json").read_text())


@pytest.fixture(scope="module")
def first_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("climb")
    summary = climb(out, 3, "--mode", "on_policy",
                    "--gin_param", "ClimbConfig.profile_start = 2",
                    "--gin_param", "ClimbConfig.profile_stop = 3")
    return out, summary


@pytest.mark.slow
def test_climb_end_to_end_writes_everything(first_run):
    out, s = first_run
    assert s["steps"] == 3 and s["mode"] == "on_policy" and s["placement"] == "single_process"
    for key in ("base_pass_at_1", "final_pass_at_1", "wall_seconds", "steps"):
        assert key in s
    assert 0.0 <= s["base_pass_at_1"] <= 1.0 and 0.0 <= s["final_pass_at_1"] <= 1.0
    # Base pre-trained by hcjax.sft into OUTPUT_DIR/base, then the climb's own outputs.
    assert (out / "base" / "checkpoints").is_dir()
    for name in ("config.gin", "operative_config.gin", "metrics.jsonl", "report.md",
                 "summary.json", "reward_vs_step.png", "reward_vs_wall.png", "entropy.png",
                 "k.png", "lengths.png", "staleness.png", "logp_gap.png",
                 "rollouts/groups.jsonl"):
        assert (out / name).is_file(), name
    assert any((out / "tb").iterdir())
    assert "ClimbConfig.num_steps = 3" in (out / "operative_config.gin").read_text()
    records = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "reward_mean" in r]
    assert [r["step"] for r in steps] == [1, 2, 3]
    assert any("heldout_pass_at_1" in r for r in records)
    # On-policy: every trained rollout came from the weights being trained (staleness 0), so the
    # learner's recomputed log-probs equal the sampler's up to fp32 noise (top-p/routing replay).
    assert all(r["staleness_max"] == 0 for r in steps)
    assert s["logp_gap_mean"] <= 1e-4
    assert all(r["version"] == r["step"] for r in steps)  # pushed after every step
    groups = read_groups(str(out / "rollouts"))
    assert groups and all(len(g.rollouts) == 4 for g in groups)
    assert "## Held-out pass@1" in (out / "report.md").read_text()
    # The XProf trace of the chosen step (ClimbConfig.profile_start/stop) is on disk.
    assert trace_files(str(out / "profile"))


@pytest.mark.slow
def test_climb_resumes_from_its_checkpoint(first_run):
    out, _ = first_run
    s = climb(out, 5)
    assert s["resumed_from"] == 3 and s["steps"] == 5 and s["mode"] == "async"
    # The base was not pre-trained again, and the store kept the first run's groups.
    assert s["base_pretrain_seconds"] < 60
    assert len(read_groups(str(out / "rollouts"), accepted_only=True)) == \
        s["accepted_groups_consumed"] + s["buffered_groups"]


# The kill/restart climb also runs the sampling-temperature lever, whose state must survive it.
TEMPERATURE = ("--gin_param", "EntropyController.temperature_delta = 0.05",
               "--gin_param", "EntropyController.temperature_range = (0.6, 1.6)")


@pytest.mark.slow
def test_kill_and_restart_loses_no_accepted_group(tiny_base, tmp_path):
    base = tiny_base
    out = tmp_path / "killed"
    proc = subprocess.Popen(command(out, 200, "--base_checkpoint", str(base), *TEMPERATURE),
                            cwd=REPO,
                            env=env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    ckpts = out / "checkpoints"
    deadline = time.time() + 300
    try:
        while time.time() < deadline:
            done = [int(p.name) for p in ckpts.glob("*") if p.name.isdigit()] \
                if ckpts.is_dir() else []
            if done and max(done) >= 3:
                break
            assert proc.poll() is None, proc.stderr.read().decode()[-2000:]
            time.sleep(0.5)
        else:
            pytest.fail("the climb wrote no checkpoint past step 3 in 300 s")
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    s = climb(out, max(done) + 3, "--base_checkpoint", str(base), *TEMPERATURE)
    assert s["resumed_from"] is not None and s["resumed_from"] >= 3
    assert s["steps"] == max(done) + 3
    accepted = read_groups(str(out / "rollouts"), accepted_only=True)
    # Every group the first process accepted (written to the store before the kill) was either
    # trained on after the restart or is still buffered: none was lost.
    assert len(accepted) == s["accepted_groups_consumed"] + s["buffered_groups"]
    # The temperature lever: after every step T moved by ±0.05 toward H* (clipped to the range),
    # and the restarted process went on from the checkpointed T (a step the killed process logged
    # past its checkpoint was run again; its last record is the one that counts).
    last: dict[int, dict] = {}
    logged = {1.0}  # every temperature any process set (the killed one's included)
    for line in (out / "metrics.jsonl").read_text().splitlines():
        r = json.loads(line)
        if "temperature" in r:
            last[r["step"]] = r
            logged.add(round(r["temperature"], 6))
    steps = sorted(last)
    assert steps == list(range(1, s["steps"] + 1))
    previous = 1.0
    for step in steps:
        r = last[step]  # a step without trained tokens has no Ĥ and keeps the temperature
        move = 0.05 * np.sign(r["entropy_target"] - r["entropy"]) if "entropy" in r else 0.0
        expected = float(np.clip(previous + move, 0.6, 1.6))
        assert abs(r["temperature"] - expected) < 1e-9, (step, r["temperature"], expected)
        previous = r["temperature"]
    # Rollouts record the temperature they were sampled at, and the learner scored them with it.
    sampled = {round(r.temperature, 6) for g in accepted for r in g.rollouts}
    assert len(sampled) > 1 and sampled <= logged


@pytest.mark.slow
def test_self_distillation_then_climb_from_the_distilled_model(first_run, tmp_path):
    """Store -> chat JSONL -> hcjax.sft from the base -> loadable as a climb's base."""
    out, _ = first_run
    sd = tmp_path / "sd.jsonl"
    written = store_main([str(out), str(sd), "--all", "--min_step_fraction", "0"])
    lines = [json.loads(x) for x in sd.read_text().splitlines()]
    assert lines and written == len(lines)
    assert all([m["role"] for m in x["messages"]] == ["user", "assistant"] for x in lines)
    sft_dir = tmp_path / "distilled"
    model = [p for p in TINY if p.startswith(("ModelConfig", "DataConfig"))]
    args = [sys.executable, "-m", "hcjax.sft", "--output_dir", str(sft_dir)]
    for p in [*model, 'DataConfig.source = "chat_jsonl"', f'DataConfig.path = "{sd}"',
              f'TrainerConfig.init_checkpoint = "{out / "base"}"', "TrainerConfig.num_steps = 2",
              "TrainerConfig.batch_size = 8", "run_sft.eval_problems = 0"]:
        args += ["--gin_param", p]
    proc = subprocess.run(args, cwd=REPO, env=env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    # The climb starts from the distilled run exactly as from a base (--base_checkpoint).
    cfg = ModelConfig(**TINY_MODEL)
    mesh = make_mesh(MeshConfig(data=1, fsdp=1, tensor=1, expert=1, num_devices=1))
    model, _ = load_model(str(sft_dir), mesh, cfg)
    params = nnx.state(model, nnx.Param)
    base_model, _ = load_model(str(out / "base"), mesh, cfg)
    base_params = nnx.state(base_model, nnx.Param)
    diff = [float(np.abs(np.asarray(a) - np.asarray(b)).max())
            for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(base_params), strict=True)]
    assert max(diff) > 0  # two SFT steps moved the weights away from the base's


@pytest.mark.slow
def test_climb_with_partial_rollouts(tiny_base, tmp_path):
    """Kimi partial rollouts end to end: a token budget below the responses' length makes the
    workers continue partial samples through the server; full-length responses still come back
    and the climb trains on them."""
    s = climb(tmp_path / "partial", 2, "--base_checkpoint", str(tiny_base),
              "--gin_param", "SamplingOptions.token_budget = 3")
    assert s["steps"] == 2
    assert s["worker_stats"]["continuations"] > 0
    groups = read_groups(str(tmp_path / "partial" / "rollouts"))
    lengths = [len(r.response_ids) for g in groups for r in g.rollouts]
    assert max(lengths) > 3  # longer than one budget: stitched from continuations
    # Every stored rollout is finished (a stop token or max_tokens), none a dangling partial.
    assert {r.finish_reason for g in groups for r in g.rollouts} <= {"stop", "length"}
