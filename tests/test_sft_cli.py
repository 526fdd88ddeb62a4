"""`python -m hcjax.sft` end to end on a tiny model: exact resume (10 steps straight == 5 steps,
stop, restart, 5 more: bit-identical parameters), the output folder's contents, traces, and the
error for a checkpoint of another model config."""

import dataclasses
import glob
import json
import math
import os
import re

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest

from hcjax.model import ModelConfig
from hcjax.model_io import read_checkpoint
from hcjax.sft import main
from tests.test_profiling import trace_files

P = [
    "ModelConfig.d_model = 32", "ModelConfig.num_layers = 2", "ModelConfig.num_heads = 2",
    "ModelConfig.num_kv_heads = 1", "ModelConfig.head_dim = 16", "ModelConfig.d_ff = 64",
    "ModelConfig.num_experts = 4", "ModelConfig.moe_latent_dim = 16", "ModelConfig.moe_d_ff = 32",
    "ModelConfig.dropout_rate = 0.1", "DataConfig.row_len = 32", "TrainerConfig.num_steps = 10",
    "TrainerConfig.batch_size = 8", "AdamWConfig.peak_lr = 1e-3", "run_sft.eval_problems = 0",
    "TrainerConfig.log_every = 2",
    "CheckpointConfig.save_every = 5", "run_sft.progress = False",
]


def _args(out, *extra):
    args = ["--gin_file", "tiny_cpu.gin", "--output_dir", str(out)]
    for p in [*P, *extra]:
        args += ["--gin_param", p]
    return args


def _params(run_dir, step):
    path = os.path.join(run_dir, "checkpoints", str(step), "state")
    return ocp.PyTreeCheckpointer().restore(path)["params"]


@pytest.mark.slow
def test_exact_resume_outputs_traces_and_config_mismatch(tmp_path):
    a, b = tmp_path / "straight", tmp_path / "resumed"
    main(_args(a, "run_sft.profile_start = 2", "run_sft.profile_stop = 4",
               "run_sft.eval_problems = 4", "run_sft.eval_max_new_tokens = 8"))
    main(_args(b, "run_sft.stop_after = 5"))  # a run that ends (is killed) after step 5
    assert sorted(os.listdir(b / "checkpoints")) == ["5"]
    main(_args(b))  # restart: resumes from step 5 with the data iterator's state

    # Another run's params as a starting point (self-distillation from a base), config checked.
    model_cfg = ModelConfig()  # as bound by the last main() call
    # Orbax gives list indices back as strings; the model's pure dict has ints.
    def ints(t):
        if not isinstance(t, dict):
            return t
        return {int(k) if k.isdigit() else k: ints(v) for k, v in t.items()}

    target = jax.tree.map(jnp.zeros_like, ints(_params(b, 10)))
    assert 0 in target["blocks"]
    loaded = read_checkpoint(str(b), model_cfg=model_cfg, target=target).params
    assert jax.tree.structure(loaded) == jax.tree.structure(target)
    np.testing.assert_array_equal(loaded["blocks"][1]["attn"]["wq"],
                                  _params(b, 10)["blocks"]["1"]["attn"]["wq"])
    with pytest.raises(ValueError, match="d_model"):
        read_checkpoint(str(b), model_cfg=dataclasses.replace(model_cfg, d_model=64),
                        target=target)

    pa, pb = _params(a, 10), _params(b, 10)
    for (path, x), y in zip(
        jax.tree_util.tree_leaves_with_path(pa), jax.tree.leaves(pb), strict=True
    ):
        assert np.array_equal(np.asarray(x), np.asarray(y)), path
    assert not np.array_equal(np.asarray(_params(a, 5)["embed"]), np.asarray(pa["embed"]))
    with open(a / "checkpoints" / "10" / "data" / "metadata") as f:
        data_a = json.load(f)
    with open(b / "checkpoints" / "10" / "data" / "metadata") as f:
        assert json.load(f) == data_a

    # The output folder of the straight run.
    for name in ("config.gin", "operative_config.gin", "metrics.jsonl", "summary.txt",
                 "loss_curve.png", "eval.json"):
        assert (a / name).is_file(), name
    assert glob.glob(str(a / "tb" / "events.out.tfevents.*"))
    assert trace_files(str(a / "profile")), "no XProf trace written for steps 2..3"
    assert "TrainerConfig.num_steps = 10" in (a / "operative_config.gin").read_text()
    steps = [json.loads(line)["step"] for line in open(a / "metrics.jsonl")]
    assert steps == [1, 2, 4, 5, 6, 8, 10]  # log steps, plus the checked-before-save step 5
    summary = (a / "summary.txt").read_text()
    assert "eval_pass_at_1" in summary and re.search(r"^steps\s+: 10$", summary, re.M)
    assert re.search(r"^resumed_from_step\s+: 5$", (b / "summary.txt").read_text(), re.M)

    # A checkpoint folder of another model config is refused with the difference named.
    with pytest.raises(ValueError, match="incompatible.*d_model.*32.*64"):
        main(_args(a, "ModelConfig.d_model = 64", "TrainerConfig.num_steps = 12"))


@pytest.mark.slow
def test_jsonl_data_ends_the_run_cleanly(tmp_path, capsys):
    data = tmp_path / "problems.jsonl"
    data.write_text("".join(
        json.dumps({"prompt": f"{a}+{b}=", "answer": str(a + b)}) + "\n"
        for a in range(10) for b in range(4)
    ))
    out = tmp_path / "run"
    result = main(_args(out, "DataConfig.source = 'problems_jsonl'", f"DataConfig.path = '{data}'",
                        "DataConfig.num_epochs = 1"))
    # 40 documents of 15-16 tokens, two per 32-token row: 20 rows = batches of 8, 8 and 4 (+4
    # empty rows), then the data ends.
    assert result.steps == 3
    out_text = capsys.readouterr().out
    assert "data exhausted after 3 steps" in out_text
    # stdout is not a terminal here, so --log_format auto writes one JSON line per logged step.
    lines = [json.loads(x) for x in out_text.splitlines() if x.startswith("{")]
    logged = [json.loads(x)["step"] for x in (out / "metrics.jsonl").read_text().splitlines()
              if "loss" in json.loads(x)]
    assert lines and [x["step"] for x in lines] == logged
    assert all(set(x) == {"step", "loss", "lr", "tokens_per_s"} for x in lines)
    assert all(math.isfinite(x["loss"]) and x["tokens_per_s"] > 0 for x in lines)
    assert sorted(os.listdir(out / "checkpoints")) == ["3"]
