"""Orbax checkpoints: round trip with data state, keep-N, interval, config mismatch errors, an
unfinished save never replacing the last good checkpoint, and a damaged latest step (truncated,
deleted or garbage files) falling back to the previous kept step with a warning naming it."""

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from hcjax.checkpoint import CheckpointConfig, Checkpointer


def _state(x):
    return {"params": {"w": jnp.full((4, 3), x, jnp.float32), "b": jnp.arange(3.0) + x},
            "step": jnp.asarray(int(x), jnp.int32)}


def test_round_trip_keep_and_interval(tmp_path):
    ck = Checkpointer(str(tmp_path), CheckpointConfig(save_every=2, keep=2), {"model": "a"})
    for step in range(1, 8):
        ck.save(step, _state(step), {"cursor": step * 10}, force=step == 7)
    ck.wait()
    assert ck.all_steps() == [6, 7]  # saved 2, 4, 6 on the interval, 7 forced; keep 2
    state, data = ck.restore(None, _state(0))
    np.testing.assert_array_equal(state["params"]["w"], np.full((4, 3), 7.0))
    assert int(state["step"]) == 7 and data == {"cursor": 70}
    state6, data6 = ck.restore(6, _state(0))
    assert float(state6["params"]["b"][0]) == 6.0 and data6 == {"cursor": 60}
    ck.close()


def test_restore_keeps_target_sharding(tmp_path):
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:4]), ("d",))
    sh = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("d"))
    target = {"w": jax.device_put(jnp.zeros(8), sh)}
    ck = Checkpointer(str(tmp_path), CheckpointConfig(async_save=False), {})
    ck.save(1, {"w": jax.device_put(jnp.arange(8.0), sh)}, force=True)
    state, _ = ck.restore(1, target)
    assert state["w"].sharding == sh
    np.testing.assert_array_equal(state["w"], np.arange(8.0))
    ck.close()


def test_incompatible_config_is_named(tmp_path):
    ck = Checkpointer(str(tmp_path), CheckpointConfig(), {"model_config": {"d_model": 64}})
    ck.save(1, _state(1), force=True)
    ck.close()
    other = Checkpointer(str(tmp_path), CheckpointConfig(), {"model_config": {"d_model": 128}})
    with pytest.raises(ValueError, match="incompatible.*d_model.*64.*128"):
        other.restore(None, _state(0))
    other.close()


def test_missing_steps(tmp_path):
    ck = Checkpointer(str(tmp_path), CheckpointConfig(), {})
    with pytest.raises(FileNotFoundError, match="no checkpoint"):
        ck.restore(None, _state(0))
    ck.save(1, _state(1), force=True)
    ck.wait()
    with pytest.raises(FileNotFoundError, match="step=5"):
        ck.restore(5, _state(0))
    ck.close()


def test_unfinished_save_does_not_replace_last_good(tmp_path):
    ck = Checkpointer(str(tmp_path), CheckpointConfig(), {})
    ck.save(1, _state(1), force=True)
    ck.close()
    # What a run killed mid-save leaves behind: a temporary folder for the next step.
    os.makedirs(tmp_path / "2.orbax-checkpoint-tmp-1234" / "state")
    ck = Checkpointer(str(tmp_path), CheckpointConfig(), {})
    assert ck.latest_step() == 1
    state, _ = ck.restore(None, _state(0))
    assert int(state["step"]) == 1
    ck.close()


def test_bad_config():
    with pytest.raises(ValueError, match="save_every=0"):
        CheckpointConfig(save_every=0)
    with pytest.raises(ValueError, match="keep=0"):
        CheckpointConfig(keep=0)


def test_restore_subtree_reads_straight_into_another_sharding(tmp_path):
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    devices = np.array(jax.devices())
    eight = NamedSharding(Mesh(devices.reshape(8), ("x",)), PartitionSpec("x", None))
    four = NamedSharding(Mesh(devices[4:].reshape(2, 2), ("a", "b")), PartitionSpec("b", "a"))
    vec = NamedSharding(Mesh(devices.reshape(8), ("x",)), PartitionSpec("x"))
    params = {"w": jax.device_put(jnp.arange(64.0).reshape(16, 4), eight),
              "blocks": {0: {"b": jax.device_put(jnp.ones(8), vec)}}}
    state = {"params": params, "opt": {"mu": jnp.zeros((1000,))}, "step": jnp.int32(3)}
    ck = Checkpointer(str(tmp_path), CheckpointConfig(async_save=False), {})
    ck.save(1, state, force=True)
    target = {"w": jax.ShapeDtypeStruct((16, 4), jnp.float32, sharding=four),
              "blocks": {0: {"b": jax.ShapeDtypeStruct((8,), jnp.bfloat16, sharding=vec)}}}
    got = ck.restore_subtree(1, "params", target)
    assert got["w"].sharding == four and got["blocks"][0]["b"].dtype == jnp.bfloat16
    assert {s.data.shape for s in got["w"].addressable_shards} == {(8, 2)}
    np.testing.assert_array_equal(got["w"], np.arange(64.0).reshape(16, 4))
    bad = {"w": jax.ShapeDtypeStruct((4, 16), jnp.float32)}
    with pytest.raises(ValueError, match="different structure"):
        ck.restore_subtree(1, "params", bad)
    bad = dict(target, w=jax.ShapeDtypeStruct((4, 16), jnp.float32))
    with pytest.raises(ValueError, match=r"params'/w has shape \(16, 4\)"):
        ck.restore_subtree(1, "params", bad)
    ck.close()


def _corrupt(step_dir, how):
    """Damage a saved step the ways a full disk, a killed copy or bit rot would."""
    data_files = [p for p in step_dir.rglob("*") if p.is_file() and p.parent.name == "d"]
    assert data_files
    if how == "truncated":
        for p in data_files:
            with open(p, "r+b") as f:
                f.truncate(p.stat().st_size // 2)
    elif how == "garbage":
        for p in data_files:
            p.write_bytes(os.urandom(p.stat().st_size))
    elif how == "data_deleted":
        for p in data_files:
            p.unlink()
    elif how == "metadata_deleted":
        (step_dir / "state" / "_METADATA").unlink()
        (step_dir / "state" / "manifest.ocdbt").unlink()
    elif how == "state_folder_deleted":
        import shutil

        shutil.rmtree(step_dir / "state")
    elif how == "meta_garbage":
        for p in (step_dir / "meta").iterdir():
            if p.name != "commit_success.txt":
                p.write_bytes(b"\x00not json{")
    elif how == "emptied":
        for p in sorted(step_dir.rglob("*"), reverse=True):
            p.rmdir() if p.is_dir() else p.unlink()
    else:
        raise ValueError(how)


@pytest.mark.parametrize("how", ["truncated", "garbage", "data_deleted", "metadata_deleted",
                                 "state_folder_deleted", "meta_garbage", "emptied"])
def test_corrupt_latest_step_falls_back_to_the_previous_kept_step(tmp_path, how):
    from hcjax.checkpoint import CheckpointFallback

    ck = Checkpointer(str(tmp_path), CheckpointConfig(keep=3, async_save=False), {"m": 1})
    for step in (1, 2, 3):
        ck.save(step, _state(step), {"cursor": step}, force=True)
    ck.close()
    _corrupt(tmp_path / "3", how)
    ck = Checkpointer(str(tmp_path), CheckpointConfig(keep=3, async_save=False), {"m": 1})
    latest = ck.latest_step()
    assert latest == 3
    with pytest.warns(CheckpointFallback, match=r"step 3 is corrupt or partial"):
        state, data = ck.restore(latest, _state(0))  # as the climb resumes: its latest step
    assert ck.restored_step == 2 and int(state["step"]) == 2 and data == {"cursor": 2}
    np.testing.assert_array_equal(state["params"]["w"], np.full((4, 3), 2.0))
    # The bad step is set aside (kept for inspection), so the run can save step 3 again.
    assert ck.all_steps() == [1, 2]
    assert [p.name.split("-")[:2] for p in tmp_path.glob("corrupt-*")] == [["corrupt", "3"]]
    ck.save(3, _state(33), {"cursor": 33}, force=True)
    state, data = ck.restore(None, _state(0))
    assert ck.restored_step == 3 and data == {"cursor": 33}
    ck.close()


def test_no_fallback_for_an_older_step_or_a_config_mismatch(tmp_path):
    from hcjax.checkpoint import CheckpointFallback, CorruptCheckpoint

    ck = Checkpointer(str(tmp_path), CheckpointConfig(keep=3, async_save=False), {"m": 1})
    for step in (1, 2):
        ck.save(step, _state(step), force=True)
    ck.close()
    _corrupt(tmp_path / "1", "truncated")
    ck = Checkpointer(str(tmp_path), CheckpointConfig(keep=3, async_save=False), {"m": 1})
    with pytest.raises(CorruptCheckpoint, match="step 1 cannot be read"):
        ck.restore(1, _state(0))  # an explicitly chosen older step: no silent substitute
    _corrupt(tmp_path / "2", "garbage")
    with pytest.warns(CheckpointFallback, match="step 2 is corrupt"):
        with pytest.raises(CorruptCheckpoint, match="no readable checkpoint.*step 2.*step 1"):
            ck.restore(None, _state(0))
    ck.close()
    other = Checkpointer(str(tmp_path / "x"), CheckpointConfig(async_save=False), {"m": 1})
    other.save(1, _state(1), force=True)
    other.save(2, _state(2), force=True)
    other.close()
    other = Checkpointer(str(tmp_path / "x"), CheckpointConfig(async_save=False), {"m": 2})
    with pytest.raises(ValueError, match="incompatible"):  # never "falls back" past a mismatch
        other.restore(None, _state(0))
    other.close()
