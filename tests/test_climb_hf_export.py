"""A tiny base trained on bytes goes to Hugging Face form and climbs from there: the byte
tokenizer's HF folder (hcjax.data.byte_hf) gives our ids and chat template exactly, and
pre-train -> `convert --to_hf` -> `climb --hf_checkpoint` runs end to end on tiny_hf_cpu.gin."""

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from hcjax.config import cpu_xla_flags
from hcjax.data import template
from hcjax.data.byte_hf import write_byte_tokenizer
from hcjax.data.hf_tokenizer import HFTokenizer
from hcjax.data.tokenizer import END_TURN, SPECIAL_TOKENS, ByteTokenizer, load_tokenizer

REPO = Path(__file__).resolve().parent.parent

TEXTS = [
    "12 + 7 =",
    "héllo wörld ✓ 😀\n\t  two  spaces, a tab\tand\r\nCRLF",
    "".join(chr(i) for i in range(1, 128)),
    "",
]


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    folder = tmp_path_factory.mktemp("byte_hf")
    written = write_byte_tokenizer(folder)
    assert sorted(written) == sorted(os.listdir(folder))
    return HFTokenizer.from_pretrained(folder), ByteTokenizer()


def test_ids_of_bytes_and_specials_are_the_byte_tokenizers(pair):
    hf, byte = pair
    assert hf.vocab_size == byte.vocab_size == 272
    assert (hf.pad_id, hf.bos_id, hf.eos_id) == (byte.pad_id, byte.bos_id, byte.eos_id)
    for i, token in enumerate(SPECIAL_TOKENS):
        assert hf.special_id(token) == byte.special_id(token) == i
    # Every single byte, including the ones that are not UTF-8 on their own.
    for b in range(256):
        assert hf.decode([16 + b]).encode("utf-8", "replace") == byte.decode([16 + b]).encode(
            "utf-8", "replace")
    for text in TEXTS:
        assert hf.encode(text) == byte.encode(text), text


def test_reasoning_tags_in_text_become_their_special_ids_as_in_our_template(pair):
    hf, byte = pair
    text = "<think>3+4</think><answer>7</answer> and <answer>8</answer>"
    assert hf.encode(text) == template.encode_content(text, byte)


def test_decode_spells_out_specials_and_round_trips(pair):
    hf, byte = pair
    ids, _ = template.encode_prompt_response(
        "What is 3 + 4?", template.reasoning_response("3+4", "7"), byte)
    assert hf.decode(ids) == byte.decode(ids)
    assert hf.decode(ids, skip_special=True) == byte.decode(ids, skip_special=True)
    assert template.hf_answer(hf.decode(ids)) == template.parse_answer(byte.decode(ids)) == "7"
    for text in TEXTS:
        assert hf.decode(hf.encode(text)) == text


def test_chat_template_renders_our_template(pair):
    hf, byte = pair
    for prompt in ["What is 3 + 4?", "Answer in <answer></answer> tags: 12 - 5", "é\n"]:
        messages = [{"role": "user", "content": prompt}]
        assert hf.apply_chat_template(messages) == template.prompt_ids(prompt, byte)
        # A whole conversation: ours without the final <eos>, which chat templates leave out.
        convo = [{"role": "system", "content": "Be brief."}, *messages,
                 {"role": "assistant", "content": template.reasoning_response("x", "7")},
                 {"role": "user", "content": "again"}]
        assert hf.apply_chat_template(convo) == template.messages_prompt_ids(convo, byte)
        ours, _ = template.encode_chat(convo, byte, add_eos=False)
        assert hf.apply_chat_template(convo, add_generation_prompt=False) == ours
    with pytest.raises(ValueError, match="role robot"):
        hf.apply_chat_template([{"role": "robot", "content": "hi"}])


def test_training_encoding_and_stop_ids_match(pair):
    hf, byte = pair
    # Sampling stops at the end of the assistant turn.
    assert set(template.stop_ids(hf)) == set(template.stop_ids(byte))
    assert byte.special_id(END_TURN) in hf.eos_ids
    # The HF path trains the reply and its <|end|>, as ours does (ours adds an untrained <eos>).
    ids, mask = template.encode_prompt_response("1 + 1 =", template.reasoning_response("", "2"),
                                                hf)
    ours, our_mask = template.encode_prompt_response(
        "1 + 1 =", template.reasoning_response("", "2"), byte)
    assert (ids, mask) == (ours[:-1], our_mask[:-1]) and ours[-1] == byte.eos_id


# --- end to end: pre-train -> convert --to_hf -> climb --hf_checkpoint -----------------------

# An HF-expressible version of tests/test_climb.py's tiny model (tiny_hf_cpu.gin's switches).
TINY_MODEL = [
    "ModelConfig.d_model = 32", "ModelConfig.num_layers = 2", "ModelConfig.num_heads = 2",
    "ModelConfig.num_kv_heads = 1", "ModelConfig.head_dim = 16", "ModelConfig.d_ff = 64",
    "ModelConfig.num_experts = 4", "ModelConfig.moe_d_ff = 32", "ModelConfig.max_seq_len = 64",
    "DataConfig.row_len = 64",
]
TINY_TASK = [
    "ArithmeticSuite.kinds = ('add',)", "ArithmeticSuite.max_digits = 1",
    "ArithmeticSuite.num_heldout = 16",
]
TINY_CLIMB = [
    "ClimbConfig.num_steps = 3", "ClimbConfig.group = 4", "ClimbConfig.early_group = 2",
    "ClimbConfig.early_window = (0.0, 1.0)", "ClimbConfig.full_window = (0.0, 1.0)",
    "SamplingOptions.max_tokens = 12", "ClimbConfig.eval_every = 2", "ClimbConfig.eval_problems = 16",
    "ClimbConfig.max_concurrent_decodes = 16", "ClimbConfig.checkpoint_every = 1",
    "ClimbConfig.max_minutes = None", "SourceConfig.sampler = 'sequential'",
    "ArithmeticSuite.extraction = 'flexible'",
    "ControllerConfig.groups_per_batch = 2", "ControllerConfig.num_workers = 4",
    "ControllerConfig.max_inflight = None", "ControllerConfig.sync_every = 2",
    "LearnerConfig.seq_len = 64",
    # A 4-step base rarely ends its turn within 12 tokens; train on truncated samples too so the
    # learner runs every step.
    "LearnerConfig.mask_truncated = False",
]


def _env() -> dict:
    e = dict(os.environ)
    e["XLA_FLAGS"] = cpu_xla_flags(2)
    e["JAX_PLATFORMS"] = "cpu"
    return e


def _run(module: str, *args: str, params=(), timeout=300) -> None:
    cmd = [sys.executable, "-m", module, *args]
    for p in params:
        cmd += ["--gin_param", p]
    proc = subprocess.run(cmd, cwd=REPO, env=_env(), capture_output=True, text=True,
                          timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-3000:]


@pytest.mark.slow
def test_tiny_base_exports_to_hf_and_climbs_through_its_chat_template(tmp_path):
    import jax.numpy as jnp
    import orbax.checkpoint as ocp

    from hcjax.model import ModelConfig, hf
    from hcjax.model_io import load_model
    from hcjax.rl.store import read_groups
    from hcjax.sharding import MeshConfig, make_mesh

    base, exported, out = tmp_path / "base", tmp_path / "hf", tmp_path / "climb"
    _run("hcjax.sft", "--gin_file", "tiny_hf_cpu.gin", "--output_dir", str(base),
         params=[*TINY_MODEL, *TINY_TASK, "TrainerConfig.num_steps = 4",
                 "TrainerConfig.batch_size = 8", "run_sft.eval_problems = 0"])
    _run("hcjax.convert", "--to_hf", str(base), "--output_dir", str(exported), "--quiet")
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
            "chat_template.jinja", "generation_config.json"} <= set(os.listdir(exported))
    config = json.loads((exported / "config.json").read_text())
    assert config["model_type"] == "qwen3_moe" and config["eos_token_id"] == [2, 11]

    # The exported folder computes the run's logits.
    model, _ = hf.load(str(exported))
    mngr = ocp.CheckpointManager(base / "checkpoints",
                                 item_handlers={"meta": ocp.JsonCheckpointHandler()})
    meta = mngr.restore(mngr.latest_step(), args=ocp.args.Composite(meta=ocp.args.JsonRestore()))
    mngr.close()
    mesh = make_mesh(MeshConfig(data=1, fsdp=1, tensor=1, expert=1, num_devices=1))
    ours, _ = load_model(str(base), mesh, ModelConfig(**meta["meta"]["model_config"]))
    tok = load_tokenizer(str(exported))
    ids = jnp.asarray([template.prompt_ids("What is 3 + 4?", tok)])
    np.testing.assert_allclose(np.asarray(model(ids).logits), np.asarray(ours(ids).logits),
                               rtol=1e-5, atol=1e-5)

    _run("hcjax.climb", "--hf_checkpoint", str(exported), "--gin_file", "tiny_hf_cpu.gin",
         "--output_dir", str(out), "--quiet", "--mode", "on_policy",
         params=[*TINY_TASK, *TINY_CLIMB])
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == 3 and summary["rollouts"] > 0
    assert 0.0 <= summary["base_pass_at_1"] <= 1.0 and 0.0 <= summary["final_pass_at_1"] <= 1.0
    # The prompts went through the folder's chat template, which is ours.
    groups = read_groups(str(out / "rollouts"))
    assert groups
    prompt = groups[0].meta["prompt"]
    prompt_ids = [int(i) for i in groups[0].rollouts[0].prompt_ids]
    assert prompt_ids == tok.apply_chat_template([{"role": "user", "content": prompt}])
    assert prompt_ids == template.prompt_ids(prompt, ByteTokenizer())
