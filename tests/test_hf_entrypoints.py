"""`--hf_checkpoint DIR` on the entry points (hcjax.serve, hcjax.sft, hcjax.climb) with the tiny
Hugging Face fixtures: the chat-template data path and its loss mask, HF-style answer grading,
flag errors, and one short end-to-end run of each entry point (random weights: only the plumbing
and the artefacts are checked, and the served greedy tokens against transformers')."""

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from hcjax.config import cpu_xla_flags, hf_checkpoint_folder
from hcjax.data.problem import TaskProblem
from hcjax.data.template import (
    encode_conversation,
    encode_prompt_response,
    hf_answer,
    normalize_answer,
    prompt_ids,
    reasoning_response,
    response_answer,
    stop_ids,
)
from hcjax.data.tokenizer import ByteTokenizer, load_tokenizer
from hcjax.tasks import ArithmeticSuite

REPO = Path(__file__).resolve().parent.parent
FIXTURES = REPO.parent / "shared" / "fixtures" / "hf"
needs_fixtures = pytest.mark.skipif(not FIXTURES.is_dir(), reason="no HF fixtures")


@pytest.fixture(scope="module")
def qwen3_tok():
    return load_tokenizer(str(FIXTURES / "qwen3"))


# The chat-template data path --------------------------------------------------------------------


@needs_fixtures
def test_hf_prompt_response_trains_only_the_reply_up_to_eos(qwen3_tok):
    tok = qwen3_tok
    target = reasoning_response("51", "15")
    ids, mask = encode_prompt_response("12+3=", target, tok)
    prompt = prompt_ids("12+3=", tok)
    # The sampler's prompt is the untrained prefix, exactly the template with generation prompt.
    assert prompt == tok.apply_chat_template([{"role": "user", "content": "12+3="}])
    assert ids[: len(prompt)] == prompt and mask[: len(prompt)] == [0] * len(prompt)
    trained = [i for i, m in zip(ids, mask, strict=True) if m]
    assert tok.decode(trained) == target + "<|im_end|>"
    # Everything rendered is there; the template's newline after <|im_end|> is not trained.
    assert tok.decode(ids) == tok.render_chat_template(
        [{"role": "user", "content": "12+3="}, {"role": "assistant", "content": target}],
        add_generation_prompt=False)
    assert mask[-1] == 0 and tok.decode(ids[-1:]) == "\n"
    assert stop_ids(tok) == tok.eos_ids == (2,)


@needs_fixtures
def test_hf_multi_turn_masks_each_assistant_turn(qwen3_tok):
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"},
            {"role": "assistant", "content": "yo"}, {"role": "user", "content": "again"},
            {"role": "assistant", "content": "ok"}]
    ids, mask = encode_conversation(msgs, qwen3_tok)
    trained = qwen3_tok.decode([i for i, m in zip(ids, mask, strict=True) if m])
    assert trained == "yo<|im_end|>ok<|im_end|>"


@needs_fixtures
def test_hf_data_pipeline_documents(qwen3_tok):
    from hcjax.train.pipeline import DataConfig, build_documents

    cfg = DataConfig(tokenizer=str(FIXTURES / "qwen3"), num_train_problems=8)
    doc = build_documents(cfg)[0]
    tokens, mask = doc["tokens"].tolist(), doc["loss_mask"].tolist()
    text = qwen3_tok.decode([t for t, m in zip(tokens, mask, strict=True) if m])
    assert text.startswith("<think>") and text.endswith("</answer><|im_end|>")
    assert qwen3_tok.decode(tokens).startswith("<|im_start|>user\n")


@needs_fixtures
def test_hf_answer_and_grading(qwen3_tok):
    assert hf_answer("<think>51</think><answer> 15 </answer><|im_end|>") == "15"
    assert hf_answer("so the sum is \\boxed{15}.") == "15"
    assert hf_answer("<think>12+3 is 14? no</think>It is 15.<|im_end|>") == "15"
    assert hf_answer("<think>still 14") is None and hf_answer("no digits") is None
    # The answer a response gives is read the way the tokenizer's template writes it.
    assert normalize_answer(response_answer("The answer is 15<|im_end|>", qwen3_tok)) == "15"
    assert response_answer("The answer is 14<|im_end|>", qwen3_tok) == "14"
    # Our own template still needs its <answer> block.
    assert response_answer("15", ByteTokenizer()) is None
    assert response_answer("<answer>15</answer>", ByteTokenizer()) == "15"
    # Evaluation grades by the suite: its flexible extraction reads a chat model's answer (set
    # ArithmeticSuite.extraction = 'flexible' for one), the strict one only our tags.
    p = TaskProblem("add-0", "add:2x1", ({"role": "user", "content": "12+3="},), reference="15")
    flexible = ArithmeticSuite(extraction="flexible")
    assert flexible.grade(p, "The answer is 15<|im_end|>").correct
    assert not flexible.grade(p, "The answer is 14<|im_end|>").correct
    assert not ArithmeticSuite().grade(p, "The answer is 15<|im_end|>").correct
    assert ArithmeticSuite().grade(p, "<answer>15</answer>").correct


@needs_fixtures
def test_climb_prompt_limit_is_measured_and_enforced(qwen3_tok):
    from hcjax.rl.sources import TaskBuilder
    from hcjax.tasks import ArithmeticSuite

    suite = ArithmeticSuite(kinds=("add", "mul"), max_digits=3, num_heldout=8)
    limit = TaskBuilder(suite, qwen3_tok).longest_prompt(scan=50)
    assert limit == max(len(prompt_ids(p.prompt, qwen3_tok))
                        for p in [*suite.heldout(), *(suite.train_problem(i) for i in range(50))])
    builder = TaskBuilder(suite, qwen3_tok, max_prompt_len=limit)
    task = builder.task(suite.train_problem(0))
    assert len(task.prompt_ids) <= limit
    # The prompt is the Hugging Face chat template's, ending with its generation prompt.
    assert list(task.prompt_ids) == prompt_ids(suite.train_problem(0).prompt, qwen3_tok)
    with pytest.raises(ValueError, match=r"-token prompt; the engine's max prefill length is 4"):
        TaskBuilder(suite, qwen3_tok, max_prompt_len=4).task(suite.train_problem(0))


# Flags ------------------------------------------------------------------------------------------


@needs_fixtures
def test_hf_checkpoint_flag_errors(tmp_path, capsys):
    from hcjax.climb import main as climb_main
    from hcjax.serve import main as serve_main
    from hcjax.sft import main as sft_main

    assert hf_checkpoint_folder(str(FIXTURES / "qwen3")) == str(FIXTURES / "qwen3")
    cases = [
        ([str(tmp_path / "missing")], "does not exist"),
        ([str(tmp_path)], "has no config.json"),
    ]
    for main in (serve_main, sft_main, climb_main):
        for args, message in cases:
            with pytest.raises(SystemExit) as e:
                main(["--hf_checkpoint", *args])
            assert e.value.code == 2
            err = capsys.readouterr().err
            assert "error: argument --hf_checkpoint" in err and message in err, err
    with pytest.raises(SystemExit) as e:
        climb_main(["--hf_checkpoint", str(FIXTURES / "qwen3"), "--base_checkpoint", "x"])
    assert e.value.code == 2
    assert "not allowed with argument" in capsys.readouterr().err


# End to end -------------------------------------------------------------------------------------


def _env(devices: int) -> dict:
    return dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(REPO),
                XLA_FLAGS=cpu_xla_flags(devices))


@needs_fixtures
@pytest.mark.slow
def test_serve_hf_checkpoint_greedy_matches_transformers(tmp_path):
    from hcjax.rollout import GenerateRequest
    from hcjax.rollout.service import RolloutClient

    folder = FIXTURES / "llama3"
    log = open(tmp_path / "serve.log", "w")
    proc = subprocess.Popen(
        [sys.executable, "-m", "hcjax.serve", "--hf_checkpoint", str(folder),
         "--gin_param", "Engine.max_concurrent_decodes = 2"],
        stdout=subprocess.PIPE, stderr=log, env=_env(1), cwd=REPO, text=True)
    try:
        line = proc.stdout.readline()
        assert line, (tmp_path / "serve.log").read_text()[-3000:]
        serving = json.loads(line)
        assert serving["event"] == "serving" and serving["eos_ids"] == [2]
        prompt = np.load(folder / "golden" / "input_ids.npy")[0, :12]
        greedy = np.load(folder / "golden" / "greedy.npy")[0]
        client = RolloutClient(f"127.0.0.1:{serving['port']}")
        req = GenerateRequest(prompt=tuple(int(t) for t in prompt), max_tokens=8,
                              temperature=0.0, top_p=1.0, seed=0)
        [record] = client.generate(req, timeout=120)
        assert record.response_ids.tolist() == greedy.tolist()
    finally:
        proc.terminate()
        proc.wait(30)
        log.close()


@needs_fixtures
@pytest.mark.slow
def test_sft_from_hf_checkpoint(tmp_path):
    import jax
    from flax import nnx

    from hcjax.checkpoint import CheckpointConfig, Checkpointer
    from hcjax.model import hf

    folder = FIXTURES / "qwen3"
    out = tmp_path / "sft"
    cmd = [sys.executable, "-m", "hcjax.sft", "--hf_checkpoint", str(folder),
           "--output_dir", str(out)]
    for p in ("TrainerConfig.num_steps = 3", "TrainerConfig.batch_size = 4",
              "AdamWConfig.peak_lr = 1e-3", "TrainerConfig.log_every = 1", "run_sft.eval_problems = 4",
              "run_sft.eval_max_new_tokens = 8"):
        cmd += ["--gin_param", p]
    proc = subprocess.run(cmd, cwd=REPO, env=_env(1), capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    losses = [json.loads(line)["loss"] for line in (out / "metrics.jsonl").read_text().split("\n")
              if line]
    assert len(losses) == 3 and all(np.isfinite(losses))
    assert json.loads((out / "eval.json").read_text())["problems"] == 4
    # The run records its source for the way back (python -m hcjax.convert --to_hf OUT).
    assert {"config.json", "tokenizer.json"} <= set(os.listdir(out / "hf"))
    # The checkpoint holds trained weights that started from (and moved away from) the fixture's.
    model, _ = hf.load(str(folder))
    start = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    ckpt = Checkpointer(str(out / "checkpoints"), CheckpointConfig(async_save=False), {})
    try:
        assert ckpt.latest_step() == 3
        trained = ckpt.restore_subtree(3, "params", start)
    finally:
        ckpt.close()
    moved = [float(np.max(np.abs(np.asarray(a) - np.asarray(b))))
             for a, b in zip(jax.tree.leaves(trained), jax.tree.leaves(start), strict=True)]
    assert all(np.isfinite(moved)) and max(moved) > 1e-4
    # Small steps from the fixture, not a fresh initialisation: every tensor stays close to it.
    assert max(moved) < 0.1


@needs_fixtures
@pytest.mark.slow
def test_climb_from_hf_moe_checkpoint(tmp_path):
    import orbax.checkpoint as ocp

    folder = FIXTURES / "qwen3_moe"
    out = tmp_path / "climb"
    params = [
        "ArithmeticSuite.kinds = ('add',)", "ArithmeticSuite.max_digits = 1",
        "ArithmeticSuite.num_heldout = 8", "ClimbConfig.num_steps = 3",
        "ClimbConfig.group = 4", "ClimbConfig.early_group = 2",
        "ClimbConfig.early_window = (0.0, 1.0)", "ClimbConfig.full_window = (0.0, 1.0)",
        "SamplingOptions.max_tokens = 8", "ClimbConfig.eval_every = 2", "ClimbConfig.eval_problems = 8",
        "ClimbConfig.max_concurrent_decodes = 16", "ClimbConfig.checkpoint_every = 1",
        "ClimbConfig.max_minutes = None", "SourceConfig.sampler = 'sequential'",
        "ArithmeticSuite.extraction = 'flexible'",
        "ControllerConfig.groups_per_batch = 2", "ControllerConfig.num_workers = 4",
        "ControllerConfig.max_inflight = None", "ControllerConfig.sync_every = 2",
        "LearnerConfig.seq_len = 64",
        # A random 512-token model rarely samples eos within 8 tokens; train on truncated samples
        # too, so the learner (with routing replay) runs every step.
        "LearnerConfig.mask_truncated = False",
    ]
    cmd = [sys.executable, "-m", "hcjax.climb", "--hf_checkpoint", str(folder),
           "--output_dir", str(out), "--quiet", "--mode", "on_policy"]
    for p in params:
        cmd += ["--gin_param", p]
    proc = subprocess.run(cmd, cwd=REPO, env=_env(2), capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == 3 and summary["rollouts"] > 0
    assert summary["base_pretrain_seconds"] < 60 and not (out / "base").exists()
    # On-policy with routing replay: the learner's log-probs are the sampler's.
    assert summary["logp_gap_mean"] < 1e-3
    # Prompts were the chat template's, grading decoded with the HF tokenizer.
    tok = load_tokenizer(str(folder))
    from hcjax.rl.store import read_groups

    group = read_groups(str(out / "rollouts"))[0]
    prompt = group.meta["prompt"]
    assert group.rollouts[0].prompt_ids.tolist() == prompt_ids(prompt, tok)
    # The HF source is recorded: in the checkpoints' meta and as OUT/hf for the export.
    assert {"config.json", "tokenizer.json"} <= set(os.listdir(out / "hf"))
    mngr = ocp.CheckpointManager(out / "checkpoints",
                                 item_handlers={"meta": ocp.JsonCheckpointHandler()})
    meta = mngr.restore(mngr.latest_step(), args=ocp.args.Composite(meta=ocp.args.JsonRestore()))
    mngr.close()
    assert meta["meta"]["hf_checkpoint"] == str(folder)
    assert meta["meta"]["hf_config"]["model_type"] == "qwen3_moe"
    # ... and the climbed model goes back to a Hugging Face folder that loads with the same config.
    from hcjax.model import hf
    from hcjax.model_io import run_to_hf

    exported = str(tmp_path / "exported")
    run_to_hf(str(out), exported, quiet=True)
    assert {"config.json", "tokenizer.json", "model.safetensors"} <= set(os.listdir(exported))
    model, cfg = hf.load(exported)
    _, source_cfg = hf.load(str(folder))
    assert cfg == source_cfg
