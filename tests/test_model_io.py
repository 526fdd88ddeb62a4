"""hcjax.model_io: a run folder's params read into a mesh's shardings exactly as written (the one
layout every job writes, the climb's learner included, and the {"value": array} layout climbs
wrote before, kept readable), the model config checked by identity (kernel choices and the
compute dtype may differ, a real difference is named), the errors for a missing folder and an
occupied one, and the tokenizer a run trained with."""

import dataclasses

import jax
import numpy as np
import pytest
from flax import nnx

from hcjax.checkpoint import CheckpointConfig, Checkpointer, IncompatibleCheckpoint, jsonable
from hcjax.data.tokenizer import ByteTokenizer, HFTokenizer
from hcjax.model import ModelConfig, create_sharded, param_shardings
from hcjax.model.hf import copy_side_files
from hcjax.model_io import (
    checkpoints_folder,
    load_model,
    model_identity,
    read_checkpoint,
    run_tokenizer,
    wrapped_params_layout,
    write_checkpoint,
)
from hcjax.rl.learner import Learner, LearnerConfig
from hcjax.sharding import MeshConfig, make_mesh
from tests.hf_fixtures import fixture

CFG = ModelConfig(vocab_size=64, d_model=16, num_layers=2, num_heads=2, num_kv_heads=1,
                  head_dim=8, d_ff=32, num_experts=2, experts_per_token=1, moe_latent_dim=8,
                  moe_d_ff=16, max_seq_len=32, dtype="float32", moe_impl="dense")


def _params(seed: int) -> dict:
    model = create_sharded(CFG, make_mesh(MeshConfig(num_devices=1)), seed=seed)
    return nnx.to_pure_dict(nnx.state(model, nnx.Param))


def _same(a, b) -> None:
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


@pytest.mark.parametrize("layout", ["plain", "old_climb"])
def test_load_model_reads_each_layout_into_the_mesh_shardings(tmp_path, layout):
    params = _params(seed=3)
    saved = params if layout == "plain" else jax.tree.map(lambda x: {"value": x}, params)
    write_checkpoint(str(tmp_path / "run"), saved, CFG, step=7)
    mesh = make_mesh(MeshConfig(fsdp=2, num_devices=2))
    model, cfg = load_model(str(tmp_path / "run"), mesh)
    assert model_identity(cfg) == model_identity(CFG)
    state = nnx.state(model, nnx.Param)
    _same(nnx.to_pure_dict(state), params)
    want = nnx.to_pure_dict(param_shardings(state, mesh))
    got = jax.tree.map(lambda x: x.sharding, nnx.to_pure_dict(state))
    assert jax.tree.leaves(got) == jax.tree.leaves(want)
    # The checkpoints folder itself reads the same; the step and meta come back too.
    loaded = read_checkpoint(str(tmp_path / "run" / "checkpoints"))
    assert loaded.step == 7 and loaded.meta["model_config"] == model_identity(CFG)
    _same(loaded.params, params)


def test_the_model_config_is_checked_by_identity(tmp_path):
    write_checkpoint(str(tmp_path / "run"), _params(seed=0), CFG)
    # Another kernel choice computes the same model: accepted, and the model built with it.
    other_kernel = dataclasses.replace(CFG, moe_impl="blocked")
    _, cfg = load_model(str(tmp_path / "run"), model_cfg=other_kernel)
    assert cfg.moe_impl == "blocked"
    wider = dataclasses.replace(CFG, d_ff=64)
    with pytest.raises(IncompatibleCheckpoint, match="d_ff: checkpoint has 32, run has 64"):
        load_model(str(tmp_path / "run"), model_cfg=wider)
    with pytest.raises(IncompatibleCheckpoint, match="d_ff"):
        read_checkpoint(str(tmp_path / "run"), model_cfg=wider)
    # The compute dtype is recorded but may differ (fp32 masters either way): a bf16 run reads
    # an fp32-written base, parameters unchanged.
    bf16 = dataclasses.replace(CFG, dtype="bfloat16")
    model, cfg = load_model(str(tmp_path / "run"), model_cfg=bf16)
    assert cfg.dtype == "bfloat16" and model.config.dtype == "bfloat16"
    _same(nnx.to_pure_dict(nnx.state(model, nnx.Param)), _params(seed=0))
    assert read_checkpoint(str(tmp_path / "run")).model_cfg.dtype == "float32"


def test_missing_and_occupied_folders_are_named(tmp_path):
    with pytest.raises(FileNotFoundError, match="nowhere"):
        checkpoints_folder(str(tmp_path / "nowhere"))
    write_checkpoint(str(tmp_path / "run"), _params(seed=0), CFG)
    with pytest.raises(FileExistsError, match="already holds checkpoints"):
        write_checkpoint(str(tmp_path / "run"), _params(seed=1), CFG)


def _leaves_equal(a, b) -> bool:
    return all(np.array_equal(x, y) for x, y in
               zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True))


def test_the_climbs_learner_writes_the_one_layout_and_resumes_either(tmp_path):
    """The learner saves plain dicts (params and their optimiser moments), which model_io reads as
    any job's; it restores them to the same state, and restores a checkpoint an older climb wrote
    in its {"value"} layout (its in-memory nnx.State form) too."""
    mesh = make_mesh(MeshConfig(num_devices=1))
    learner = Learner(create_sharded(CFG, mesh, seed=3), LearnerConfig(seq_len=16), mesh)
    for name, save in (("plain", learner.save),
                       ("old_climb", lambda ck, step, data, force: ck.save(
                           step, learner.state, data, force=force))):
        ck = Checkpointer(str(tmp_path / name / "checkpoints"),
                          CheckpointConfig(async_save=False), {"model_config": jsonable(CFG)})
        save(ck, 5, {"consumed": 2}, force=True)
        assert wrapped_params_layout(ck, 5) == (name == "old_climb")
        other = Learner(create_sharded(CFG, mesh, seed=4), LearnerConfig(seq_len=16), mesh)
        assert other.restore(ck, 5) == {"consumed": 2}
        ck.close()
        assert jax.tree.structure(other.state) == jax.tree.structure(learner.state)
        assert _leaves_equal(other.state, learner.state)
        loaded = read_checkpoint(str(tmp_path / name))
        assert loaded.step == 5 and _leaves_equal(loaded.params,
                                                  nnx.to_pure_dict(learner.state.params))


@pytest.mark.parametrize("layout", ["plain", "old_climb"])
def test_the_learner_resumes_past_a_truncated_latest_step(tmp_path, layout):
    """A latest step whose files were cut short (its metadata unreadable too) is set aside with a
    CheckpointFallback warning and the learner resumes from the previous kept step, in either
    layout (bench.chaos's corrupt-checkpoint fault, as a unit)."""
    from hcjax.checkpoint import CheckpointFallback
    from tests.test_checkpoint import _corrupt

    mesh = make_mesh(MeshConfig(num_devices=1))
    learner = Learner(create_sharded(CFG, mesh, seed=3), LearnerConfig(seq_len=16), mesh)
    folder = tmp_path / "checkpoints"
    ck = Checkpointer(str(folder), CheckpointConfig(async_save=False),
                      {"model_config": jsonable(CFG)})
    for step in (4, 5):
        if layout == "plain":
            learner.save(ck, step, {"consumed": step}, force=True)
        else:
            ck.save(step, learner.state, {"consumed": step}, force=True)
    ck.close()
    _corrupt(folder / "5", "truncated")
    ck = Checkpointer(str(folder), CheckpointConfig(async_save=False),
                      {"model_config": jsonable(CFG)})
    other = Learner(create_sharded(CFG, mesh, seed=4), LearnerConfig(seq_len=16), mesh)
    with pytest.warns(CheckpointFallback, match="step 5 is corrupt or partial"):
        assert other.restore(ck, 5) == {"consumed": 4}
    assert ck.restored_step == 4 and ck.all_steps() == [4]
    assert _leaves_equal(other.state, learner.state)
    ck.close()


def test_a_runs_tokenizer_is_its_hugging_face_sources_or_the_byte_tokenizer(tmp_path):
    write_checkpoint(str(tmp_path / "byte"), _params(seed=0), CFG)
    assert isinstance(run_tokenizer(str(tmp_path / "byte")), ByteTokenizer)
    qwen3 = fixture("qwen3")
    want = HFTokenizer.from_pretrained(qwen3).encode("12+30=")
    # The copy of the source's tokenizer files a run keeps under RUN/hf (hf_source_meta) ...
    copy_side_files(qwen3, str(tmp_path / "copied" / "hf"))
    write_checkpoint(str(tmp_path / "copied"), _params(seed=0), CFG)
    assert run_tokenizer(str(tmp_path / "copied")).encode("12+30=") == want
    # ... else the source folder its checkpoints' meta records.
    write_checkpoint(str(tmp_path / "recorded"), _params(seed=0), CFG,
                     extra_meta={"hf_checkpoint": qwen3})
    assert run_tokenizer(str(tmp_path / "recorded")).encode("12+30=") == want
    write_checkpoint(str(tmp_path / "gone"), _params(seed=0), CFG,
                     extra_meta={"hf_checkpoint": str(tmp_path / "nowhere")})
    with pytest.raises(FileNotFoundError, match="nowhere"):
        run_tokenizer(str(tmp_path / "gone"))
